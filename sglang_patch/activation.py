"""Bringing the dump hook up in one scheduler process, once SGLang has set the capture ids.

SGLang 0.5.23 fills ``layers_to_capture`` in ``init_attention_backends``, after ``load_model``,
and that may move between versions, so attention-TP rank 0 looks at three points: after
``load_model``, after ``init_attention_backends``, and at each forward holding a request of
ours. Until the ids are known nothing is written and such a request gets a ``<rid>.err``
naming the fix. The weights identity is computed once, published in the marker and each dump.
Test: tests/sglang/test_plugin.py::test_ids_that_arrive_late_bring_the_hook_up_at_the_first_request
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from engine_dump import dumpdir
from engine_dump.checkpoint import loaded_weights, model_config_sha256, served_weights
from engine_dump.dump_writer import remove_stale_files, write_err
from engine_dump.dumpfile import (
    AUX_LAYERS,
    DTYPE_BF16,
    ENV_DUMP_DTYPE,
    ERR_HOOK_INACTIVE,
    M_CONFIG_SHA,
    M_LAYERS,
    M_PATCH_VERSION,
    M_SERVER_VERSION,
    M_WEIGHTS,
    PATCH_VERSION,
)
from engine_dump.engines import dp_groups
from engine_dump.markers import write_ready_marker
from engine_dump.rids import parse_rid
from sglang_patch.layout import LayoutError, sglang_version
from sglang_patch.sglang_hook import DumpHook

log = logging.getLogger("hsfarm.sglang_plugin")

ENV_QUEUE = "SGLANG_HS_DUMP_QUEUE"  # finished requests buffered for the writer (backpressure)
ENV_RESERVE = "SGLANG_HS_DUMP_RESERVE_BYTES"  # free tmpfs kept; a dump that would not fit → .err

NO_IDS_FIX = (f"{ERR_HOOK_INACTIVE}: SGLang never set the model's aux-capture "
              "layer ids (layers_to_capture is empty after load_model, after "
              "init_attention_backends and at this request), so no hidden states can be "
              "dumped; launch with --enable-return-aux-hidden-states --speculative-algorithm "
              "EAGLE3 [--return-aux-hidden-state-layer-ids ...] and run `python -m sglang_patch "
              "verify` with the server's python: this SGLang may set the ids elsewhere")


def find_layers_to_capture(model: Any) -> list[int]:
    """The effective capture ids, wherever the model family keeps them (Kimi wraps DSV3)."""
    for module in model.modules():
        layers = getattr(module, "layers_to_capture", None)
        if layers:
            return [int(i) for i in layers]
    return []


class Activation:
    """The hook of one scheduler process (attention-TP rank 0): pending until the ids exist."""

    def __init__(self, runner: Any, dump_dir: Path) -> None:
        self.runner = runner
        self.dump_dir = dump_dir
        self.weights = loaded_weights(str(runner.server_args.model_path),
                                      getattr(runner.server_args, "revision", None),
                                      getattr(runner.server_args, "download_dir", None))
        self.hook: DumpHook | None = None
        self._lock = threading.Lock()

    def try_activate(self, where: str) -> DumpHook | None:
        """Build the hook and its ready marker if the capture ids are known now.

        Raises:
            LayoutError: the model captures a number of layers other than three.
        """
        with self._lock:
            if self.hook is None:
                layers = find_layers_to_capture(self.runner.model)
                if layers:
                    self.hook = self._build(layers, where)
        return self.hook

    def _build(self, layers: list[int], where: str) -> DumpHook:
        if len(layers) != AUX_LAYERS:
            raise LayoutError(f"the model captures layers {layers}, the farm needs exactly "
                              f"{AUX_LAYERS} (EAGLE-3's low/middle/high); pass three ids to "
                              "--return-aux-hidden-state-layer-ids or none")
        info = marker_info(self.runner, layers, where)
        meta = {
            M_LAYERS: json.dumps(layers),
            M_CONFIG_SHA: str(info["model_config_sha256"]),
            M_PATCH_VERSION: PATCH_VERSION,
            M_SERVER_VERSION: str(info["server_version"]),
            M_WEIGHTS: served_weights(self.weights, str(info["model_path"])),
        }
        info["weights"] = self.weights
        info["dump_dtype"] = os.environ.get(ENV_DUMP_DTYPE) or DTYPE_BF16
        dumpdir.ensure(self.dump_dir)
        stale = remove_stale_files(self.dump_dir)
        hook = DumpHook(self.dump_dir, meta,
                        max_queue=int(os.environ.get(ENV_QUEUE, "4")),
                        reserve_bytes=int(os.environ.get(ENV_RESERVE, str(1 << 30))),
                        dtype=os.environ.get(ENV_DUMP_DTYPE) or DTYPE_BF16)
        write_ready_marker(self.dump_dir, info)
        log.info("hsfarm dump hook active (ids known %s): layers %s, dump dir %s, %d stale "
                 "files of dead processes removed", where, layers, self.dump_dir, stale)
        return hook

    def fail_finished_requests(self, forward_batch: Any, message: str = NO_IDS_FIX) -> None:
        """``<rid>.err`` with the fix for each request of ours whose prompt ends in this pass."""
        rids = list(forward_batch.rids or [])
        prefixes = forward_batch.extend_prefix_lens_cpu
        extends = forward_batch.extend_seq_lens_cpu
        for i, rid_s in enumerate(rids):
            rid = parse_rid(rid_s)
            if rid is None:
                continue
            if prefixes is not None and extends is not None:
                prefix = int(prefixes[i])
                if not prefix < rid.token_count <= prefix + int(extends[i]):
                    continue  # not this request's last prompt chunk
            write_err(self.dump_dir, rid_s, message)


def marker_info(runner: Any, layers: list[int], where: str) -> dict[str, object]:
    """What the ready marker says: versions, the effective ids, the model, the layout."""
    args = runner.server_args
    config_sha = model_config_sha256(str(args.model_path))
    return {
        "server_version": f"sglang-{sglang_version()}",
        "sglang_version": sglang_version(),
        "layers_to_capture": layers,
        "ids_known": where,
        "model_path": str(args.model_path),
        "model_config_sha256": config_sha,
        "hidden_size": int(getattr(runner.model_config, "hidden_size", 0)),
        "tp_size": int(getattr(args, "tp_size", 1)),
        # under DP attention one writer per DP group: which group this marker's process writes
        "dp_groups": dp_groups(args),
        "attn_dp_rank": attn_dp_rank(),
    }


def attn_dp_rank() -> int | None:
    """This process's DP group; None where SGLang has not published it (the marker is for
    people and ``verify``: it never keeps the hook from coming up)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().attn_dp_rank)
    except (AttributeError, RuntimeError):
        return None
