"""The SGLang plugin: entry point ``sglang.srt.plugins: hsfarm_dump = sglang_patch.plugin:load``.

SGLang runs ``load_plugins()`` in every scheduler process (spawned: a monkeypatch in the
launcher would never reach them). With ``SGLANG_HS_DUMP_DIR`` set, ``load`` registers three
AROUND hooks in SGLang's ``HookRegistry``: ``load_model`` (refuses the layout, dump dtype or
dump dir before any weight loads; only attention-TP rank 0 builds a writer),
``init_attention_backends`` (where the capture ids are set) and ``LogitsProcessor.forward``.
Test: tests/sglang/test_plugin.py::test_sglang_loader_installs_plugin_only_with_variable
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from engine_dump import engines
from sglang_patch.layout import LayoutError

log = logging.getLogger("hsfarm.sglang_plugin")

ENV_DUMP_DIR = engines.DUMP_DIR_VARIABLE[engines.SGLANG]
TARGET_LOAD = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
TARGET_ATTN = "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends"
TARGET_LOGITS = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
# What verify checks: each target's leading parameters, as SGLang 0.5.23 defines them.
EXPECTED_PARAMS = {
    TARGET_LOAD: ["self"],
    TARGET_ATTN: ["self"],
    TARGET_LOGITS: ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata",
                    "aux_hidden_states"],
}

__all__ = ["EXPECTED_PARAMS", "LayoutError", "load"]

_activation: Any = None  # this process's Activation, on the writing rank only
_hook: Any = None  # its DumpHook, once the capture ids are known


def load() -> None:
    """Plugin entry point: register the hooks when ``SGLANG_HS_DUMP_DIR`` is set."""
    if not os.environ.get(ENV_DUMP_DIR):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET_LOAD, around_load_model, HookType.AROUND)
    HookRegistry.register(TARGET_ATTN, around_init_attention_backends, HookType.AROUND)
    HookRegistry.register(TARGET_LOGITS, around_logits_forward, HookType.AROUND)
    log.info("hsfarm dump hooks registered (dump dir %s)", os.environ[ENV_DUMP_DIR])


def around_load_model(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """Check the layout and the dump dir before loading weights; remember the writing rank's
    runner after."""
    from engine_dump import dumpdir
    from engine_dump.dumpfile import DTYPE_BF16, ENV_DUMP_DTYPE, STORE_DTYPES
    from sglang_patch.layout import layout_problems, sglang_version, version_problem

    too_old = version_problem(sglang_version())
    problems = [too_old] if too_old else layout_problems(runner.server_args)
    dtype = os.environ.get(ENV_DUMP_DTYPE) or DTYPE_BF16
    if dtype not in STORE_DTYPES:
        problems.append(f"{ENV_DUMP_DTYPE}={dtype!r}: set it to one of "
                        f"{', '.join(STORE_DTYPES)} (or unset: bfloat16)")
    if problems:
        raise LayoutError("hsfarm dump hook cannot run with this launch: " + "; ".join(problems))
    dumpdir.ensure(Path(os.environ[ENV_DUMP_DIR]))  # DumpDirUnsafe stops the server, with the fix
    result = original(runner, *args, **kwargs)
    if getattr(runner, "is_draft_worker", False) or attn_tp_rank() != 0:
        return result
    from sglang_patch.activation import Activation

    global _activation
    _activation = Activation(runner, Path(os.environ[ENV_DUMP_DIR]))
    _activate("after load_model")
    return result


def around_init_attention_backends(original: Any, runner: Any, *args: Any,
                                   **kwargs: Any) -> Any:
    """SGLang 0.5.23 sets the capture ids here: bring the hook up right after."""
    result = original(runner, *args, **kwargs)
    ours = _activation is not None and _activation.runner is runner
    if ours and _activate("after init_attention_backends") is None:
        log.warning("hsfarm: the model's capture ids are still unknown after "
                        "init_attention_backends; looking again at the first request of ours")
    return result


def _activate(where: str) -> Any:
    """This process's DumpHook if the ids are known now (built on the first call that sees
    them), else None."""
    global _hook
    if _hook is None and _activation is not None:
        _hook = _activation.try_activate(where)
    return _hook


def attn_tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().attn_tp_rank)


def around_logits_forward(original: Any, processor: Any, input_ids: Any, hidden_states: Any,
                          lm_head: Any, logits_metadata: Any, aux_hidden_states: Any = None,
                          *args: Any, **kwargs: Any) -> Any:
    """Dump our requests' rows, then run the LM head as usual. The token ids come from the
    ForwardBatch, not ``input_ids``: Kimi-K2.5 passes ``input_ids=None`` to its language model."""
    hook = _hook if _hook is not None else _activate_at_request(logits_metadata)
    if hook is not None:
        hook.on_logits(hidden_states, logits_metadata, aux_hidden_states)
    return original(processor, input_ids, hidden_states, lm_head, logits_metadata,
                    aux_hidden_states, *args, **kwargs)


def _activate_at_request(forward_batch: Any) -> Any:
    """The lazy path: a batch of ours while the ids are unknown. None if they still are
    (and then our requests that finish in this batch get their ``.err``)."""
    if _activation is None:
        return None  # not the writing rank, or no model loaded through the hook
    from sglang_patch.sglang_hook import our_rids

    if not our_rids(forward_batch):
        return None
    try:
        hook = _activate("at the first request")
    except LayoutError as e:  # never crash a serving process: answer our requests instead
        _activation.fail_finished_requests(forward_batch, str(e))
        return None
    if hook is None:
        _activation.fail_finished_requests(forward_batch)
    return hook
