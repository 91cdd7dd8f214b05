"""``HsfarmConnector``: vLLM's hidden-states KV connector, writing the farm's dump contract.

With ``extract_hidden_states``, vLLM caches every prompt token's aux rows in KV blocks, chunked
prefill and prefix-cache hits included. When a request carrying ``kv_transfer_params:
{"hsfarm_rid": <rid>}`` finishes, the scheduler side holds its blocks; TP rank 0 reads them,
normalises id L with the model's own final norm and hands the request to the engine-neutral
``DumpCollector`` (temp file, atomic rename, ``.err``). Only then are the blocks freed.
Test: tests/vllm/test_live.py::test_unchunked_values_match_transformers
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from engine_dump import dumpdir
from engine_dump.checkpoint import loaded_weights, model_config_sha256, served_weights
from engine_dump.cuda_stager import stager_for
from engine_dump.dump_writer import (
    DumpCollector,
    DumpWriter,
    Failed,
    remove_stale_files,
    write_err,
)
from engine_dump.dumpfile import (
    DTYPE_BF16,
    ERR_HOOK_INACTIVE,
    M_CONFIG_SHA,
    M_LAYERS,
    M_PATCH_VERSION,
    M_SERVER_VERSION,
    M_WEIGHTS,
    PATCH_VERSION,
)
from engine_dump.markers import write_ready_marker
from engine_dump.rids import parse_rid
from vllm_hook.layout import (
    ENV_DUMP_DIR,
    ENV_DUMP_DTYPE,
    RID_PARAM,
    LayoutError,
    layout_problems,
    split_ids,
)
from vllm_hook.verify import vllm_version

# a child of vLLM's own logger, so its lines are in the server's log like vLLM's
log = logging.getLogger("vllm.hsfarm")

ENV_QUEUE = "HSFARM_VLLM_DUMP_QUEUE"  # finished requests buffered for the writer (backpressure)
ENV_RESERVE = "HSFARM_VLLM_DUMP_RESERVE_BYTES"  # free tmpfs kept; a dump that won't fit → .err


@dataclass
class Save:
    """One finished request of ours, for TP rank 0: its rows' blocks, or why it has none."""

    req_id: str
    rid: str
    token_ids: list[int]
    block_ids: list[int]
    held: bool  # the scheduler holds its blocks until the worker reports it done
    error: str = ""


@dataclass
class HsfarmMetadata(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)


def rid_of(kv_transfer_params: object) -> str | None:
    """The farm's rid a request carries, or None for any request that is not ours."""
    if not isinstance(kv_transfer_params, dict):
        return None
    rid = kv_transfer_params.get(RID_PARAM)
    return rid if parse_rid(rid) is not None else None


def dump_dtype() -> str:
    return os.environ.get(ENV_DUMP_DTYPE) or DTYPE_BF16


def launch_ids(vllm_config: Any) -> tuple[str | None, list[int], int]:
    """(speculative method, aux ids, num_speculative_tokens) of a launch."""
    spec = vllm_config.speculative_config
    if spec is None:
        return None, [], 0
    hf = spec.draft_model_config.hf_config
    ids = [int(i) for i in getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or []]
    return spec.method, ids, int(spec.num_speculative_tokens or 0)


def check_launch(vllm_config: Any) -> tuple[list[int], int]:
    """The three aux ids and the id of ``hidden_state``; raises LayoutError with the fixes."""
    if not os.environ.get(ENV_DUMP_DIR):
        raise LayoutError(f"the hsfarm connector needs its dump dir: set {ENV_DUMP_DIR} (a "
                          "tmpfs dir the farm's workers read) in the server's environment")
    method, ids, spec_tokens = launch_ids(vllm_config)
    num_layers = int(vllm_config.model_config.get_total_num_hidden_layers())
    pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
    arch, carries = pp_aux(vllm_config) if pp_size != 1 else ("", False)
    problems = layout_problems(method, ids, num_layers, spec_tokens, pp_size, dump_dtype(),
                               vllm_version(), pp_carries_aux=carries, arch=arch)
    split = split_ids(ids, num_layers)
    if problems or split is None:
        raise LayoutError("hsfarm dump hook cannot run with this launch: " + "; ".join(problems))
    return split


def pp_aux(vllm_config: Any) -> tuple[str, bool]:
    """(the model's architecture, whether vLLM relays its aux states across PP stages)."""
    from vllm.model_executor.models import ModelRegistry

    model_config = vllm_config.model_config
    archs = list(getattr(model_config, "architectures", None) or [])
    try:
        cls, arch = ModelRegistry.resolve_model_cls(archs, model_config)
    except Exception:  # an unresolvable class: treat as not declaring it (refused)
        return (archs[0] if archs else "this model"), False
    return arch, bool(getattr(cls, "supports_aux_hidden_states_over_pp", False))


class HsfarmConnector(ExampleHiddenStatesConnector):
    """Store-only: nothing is loaded; requests not ours free their blocks as usual."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        self.aux_ids, self.last_id = check_launch(vllm_config)
        self.dump_dir = Path(os.environ[ENV_DUMP_DIR])
        dumpdir.ensure(self.dump_dir)  # DumpDirUnsafe stops the server, with the fix
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._saves: list[Save] = []  # scheduler side: finished since the last step
        self.writer: DumpWriter | None = None  # worker side, TP rank 0, once registered
        self.collector: DumpCollector | None = None  # at the first dump: its stager fits the rows
        self.norm: torch.nn.Module | None = None

    # --- scheduler side ---------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = HsfarmMetadata(saves=self._saves)
        self._saves = []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a finished request of ours until rank 0 has read them."""
        rid = rid_of(request.kv_transfer_params)
        if rid is None:
            return False, None
        prompt = list(request.prompt_token_ids or [])
        done = int(request.num_computed_tokens) - int(getattr(request, "num_in_flight_tokens", 0))
        error = ""
        if not prompt:
            error = "no prompt token ids (a prompt given as embeddings cannot be dumped)"
        elif done < len(prompt) or not block_ids:
            error = (f"incomplete: {max(done, 0)} of {len(prompt)} prompt tokens computed "
                     f"when the request finished ({request.status.name})")
        held = not error
        self._saves.append(Save(request.request_id, rid, prompt, list(block_ids) if held else [],
                                held, error))
        return held, {RID_PARAM: rid}

    # --- worker side ------------------------------------------------------------------------

    def wait_for_save(self) -> None:
        pass  # no lock files: a dump appears whole, by rename

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Find the cache, then on TP rank 0 the model's norm, and start the writer."""
        super().register_kv_caches(kv_caches)
        if self._is_tp_rank_zero and self.writer is None:
            self.norm = find_final_norm(self.aux_ids, self.last_id)
            self.writer = self._start_writer()

    def _start_writer(self) -> DumpWriter:
        cfg = self._vllm_config
        info = marker_info(cfg, self.aux_ids, self.last_id)
        weights = loaded_weights(str(cfg.model_config.model), cfg.model_config.revision,
                                 cfg.load_config.download_dir)
        meta = {M_LAYERS: json.dumps(self.aux_ids),
                M_CONFIG_SHA: str(info["model_config_sha256"]),
                M_PATCH_VERSION: PATCH_VERSION,
                M_SERVER_VERSION: str(info["server_version"]),
                M_WEIGHTS: served_weights(weights, str(info["model_path"]))}
        stale = remove_stale_files(self.dump_dir)
        writer = DumpWriter(self.dump_dir, meta, max_queue=int(os.environ.get(ENV_QUEUE, "4")),
                            min_free_bytes=int(os.environ.get(ENV_RESERVE, str(1 << 30))),
                            dtype=dump_dtype())
        write_ready_marker(self.dump_dir, {**info, "weights": weights, "dump_dtype": dump_dtype()})
        log.info("hsfarm dump hook active: aux ids %s, hidden_state = final norm of id %d, dump "
                 "dir %s, %d stale files of dead processes removed", self.aux_ids, self.last_id,
                 self.dump_dir, stale)
        return writer

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Dump this step's finished requests of ours; report each held one done (its rows
        are copied off its blocks, in stream order, before any later step reuses them)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, HsfarmMetadata) or not self._is_tp_rank_zero:
            return None, None
        done = set()
        for save in meta.saves:
            self._dump(save)
            if save.held:
                done.add(save.req_id)
        return done or None, None

    def _dump(self, save: Save) -> None:
        writer = self.writer
        if writer is None:
            write_err(self.dump_dir, save.rid, f"{ERR_HOOK_INACTIVE}: the request finished "
                      "before the writer started")
            return
        if save.error:
            writer.submit(Failed(save.rid, save.error))
            return
        try:
            ids, hidden, aux = self.rows(save)
            if self.collector is None:  # GPU rows: copied on a side stream, off the step's path
                self.collector = DumpCollector(writer, stager=stager_for(hidden))
            self.collector.on_request(save.rid, ids, hidden, aux)
        except Exception as e:  # a serving process never dies for a dump: the request's .err
            log.exception("hsfarm: cannot dump %s", save.rid)
            writer.submit(Failed(save.rid, f"hook failed: {type(e).__name__}: {e}"))

    @torch.inference_mode()
    def rows(self, save: Save) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A request's token ids, ``hidden_state`` [n, H] and ``aux_hidden_state`` [n, 3H]."""
        assert self._kv_cache is not None and self.norm is not None
        n = len(save.token_ids)
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n)
        if rows.shape[0] != n or rows.shape[1] != len(self.aux_ids) + 1:
            raise ValueError(f"hidden-states cache gave rows {tuple(rows.shape)} for {n} tokens "
                             f"and ids {[*self.aux_ids, self.last_id]}")
        aux = rows[:, : len(self.aux_ids)].reshape(n, -1)
        hidden = self.norm(rows[:, -1].contiguous())
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        return torch.tensor(save.token_ids, dtype=torch.int64), hidden, aux

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        super().shutdown()


def find_final_norm(aux_ids: list[int], last_id: int) -> torch.nn.Module:
    """The final norm of the model this worker serves: the ``norm`` of the module vLLM set
    the aux ids on. A connector gets no handle on the model, so it is looked up once among
    live objects. Raises LayoutError when there is not exactly one such module."""
    want = (*aux_ids, last_id)
    found = [o for o in gc.get_objects()
             if isinstance(o, torch.nn.Module)
             and _ids(getattr(o, "aux_hidden_state_layers", None)) == want
             and isinstance(getattr(o, "norm", None), torch.nn.Module)]
    if len(found) != 1:
        raise LayoutError(f"hsfarm dump hook: {len(found)} modules of this worker carry the aux "
                          f"ids {list(want)} and a final norm (expected one); this model or "
                          "vLLM release keeps them elsewhere: run `python -m vllm_hook verify`")
    return found[0].norm


def _ids(layers: Any) -> tuple[int, ...]:
    """A module's aux ids as vLLM captures them: by layer (DeepSeek keeps them as given)."""
    try:
        return tuple(sorted({int(i) for i in layers or ()}))
    except (TypeError, ValueError):
        return ()


def server_id(cfg: Any) -> str:
    """One id for every engine and worker of a server start (a marker's ``server``): vLLM's
    KV engine_id, a uuid drawn in the API server, less the ``_dp<rank>`` each DP rank's engine
    adds to it (vllm/v1/engine/core.py run_engine_core). The hook's writer is a worker process
    whose parent is its rank's engine core, so the parent pid differs across DP ranks."""
    return re.sub(r"_dp\d+$", "", str(cfg.kv_transfer_config.engine_id))


def marker_info(cfg: Any, aux_ids: list[int], last_id: int) -> dict[str, object]:
    """What the ready marker says: versions, the ids, the model, the layout."""
    version = vllm_version()
    par = cfg.parallel_config
    return {
        "engine": "vllm",
        "server_version": f"vllm-{version}",
        "vllm_version": version,
        "layers_to_capture": aux_ids,
        "hidden_state_of_id": last_id,
        "ids_known": "at register_kv_caches",
        "model_path": str(cfg.model_config.model),
        "model_config_sha256": model_config_sha256(str(cfg.model_config.model)),
        "hidden_size": int(cfg.model_config.get_hidden_size()),
        "tp_size": int(par.tensor_parallel_size),
        "server_id": server_id(cfg),
        # one engine (and one writer) per DP rank: which one this marker's process is. A
        # dense model's ranks run as independent engines, each reconfigured as rank 0 of 1
        # (vllm/config/parallel.py reconfigure_for_independent_dp_rank); only
        # data_parallel_index keeps the rank, and the readers count the ranks
        # (engine_dump.markers.dp_groups)
        "dp_groups": int(par.data_parallel_size),
        "attn_dp_rank": int(getattr(par, "data_parallel_index", par.data_parallel_rank)),
        # what a worker sizes admission and the canary by (vLLM's HTTP API does not say)
        "max_model_len": int(cfg.model_config.max_model_len),
        "max_num_batched_tokens": int(cfg.scheduler_config.max_num_batched_tokens),
        "max_num_seqs": int(cfg.scheduler_config.max_num_seqs),
    }
