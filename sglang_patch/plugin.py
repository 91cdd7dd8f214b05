"""The SGLang plugin: entry point ``sglang.srt.plugins: hsfarm_dump = sglang_patch.plugin:load``.

SGLang runs ``load_plugins()`` at the start of every scheduler process (they are spawned, so a
monkeypatch in the launcher would never reach them). When ``SGLANG_HS_DUMP_DIR`` is set,
``load`` registers two AROUND hooks through SGLang's own ``HookRegistry``; without it, it
returns at once and nothing is patched.

- ``ModelRunner.load_model``: refuses layouts the hook cannot handle (``layout.py``), then,
  on the attention-TP rank 0 only, builds the dump hook and writes the ready marker with the
  effective layer ids. Other ranks build nothing: no copy, no synchronisation.
- ``LogitsProcessor.forward``: before the LM head, hands the batch's rows (final post-norm
  hidden states, packed aux states, token ids from the ForwardBatch, since Kimi-K2.5 passes
  ``input_ids=None`` to its language model) to the shared ``DumpCollector``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from sglang_patch import contracts as c

log = logging.getLogger("hsfarm.sglang_plugin")

ENV_DUMP_DIR = "SGLANG_HS_DUMP_DIR"
ENV_QUEUE = "SGLANG_HS_DUMP_QUEUE"  # finished requests buffered for the writer (backpressure)
ENV_RESERVE = "SGLANG_HS_DUMP_RESERVE_BYTES"  # free tmpfs kept; a dump that would not fit → .err
TARGET_LOAD = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
TARGET_LOGITS = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
# What verify checks: each target's leading parameters, as SGLang 0.5.23 defines them.
EXPECTED_PARAMS = {
    TARGET_LOAD: ["self"],
    TARGET_LOGITS: ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata",
                    "aux_hidden_states"],
}


class LayoutError(RuntimeError):
    """The server was launched with options the dump hook cannot handle correctly."""


_hook: Any = None  # this process's DumpHook, on the writing rank only


def load() -> None:
    """Plugin entry point: register the hooks when ``SGLANG_HS_DUMP_DIR`` is set."""
    if not os.environ.get(ENV_DUMP_DIR):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET_LOAD, around_load_model, HookType.AROUND)
    HookRegistry.register(TARGET_LOGITS, around_logits_forward, HookType.AROUND)
    log.info("hsfarm dump hooks registered (dump dir %s)", os.environ[ENV_DUMP_DIR])


def around_load_model(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """Check the layout before loading weights; set up the writer after."""
    from sglang_patch.layout import layout_problems

    problems = layout_problems(runner.server_args)
    if problems:
        raise LayoutError("hsfarm dump hook cannot run with this launch: " + "; ".join(problems))
    result = original(runner, *args, **kwargs)
    if getattr(runner, "is_draft_worker", False):
        return result
    global _hook
    if attn_tp_rank() == 0:
        _hook = build_hook(runner)
    return result


def attn_tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().attn_tp_rank)


def find_layers_to_capture(model: Any) -> list[int]:
    """The effective capture ids, wherever the model family keeps them (Kimi wraps DSV3)."""
    for module in model.modules():
        layers = getattr(module, "layers_to_capture", None)
        if layers:
            return [int(i) for i in layers]
    return []


def model_config_sha256(model_path: str) -> str:
    path = Path(model_path) / "config.json"
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def build_hook(runner: Any) -> Any:
    """The DumpHook for this process, and its ready marker."""
    from sglang_patch.sglang_hook import DumpHook

    args = runner.server_args
    layers = find_layers_to_capture(runner.model)
    if len(layers) != c.AUX_LAYERS:
        raise LayoutError(f"the model captures layers {layers}, expected {c.AUX_LAYERS}; is "
                          "--enable-return-aux-hidden-states set?")
    dump_dir = Path(os.environ[ENV_DUMP_DIR])
    info = {
        "server_version": f"sglang-{sglang_version()}",
        "sglang_version": sglang_version(),
        "layers_to_capture": layers,
        "model_path": str(args.model_path),
        "model_config_sha256": model_config_sha256(str(args.model_path)),
        "hidden_size": int(getattr(runner.model_config, "hidden_size", 0)),
        "tp_size": int(getattr(args, "tp_size", 1)),
    }
    meta = {
        c.M_LAYERS: json.dumps(layers),
        c.M_CONFIG_SHA: str(info["model_config_sha256"]),
        c.M_PATCH_VERSION: c.PATCH_VERSION,
        c.M_SERVER_VERSION: str(info["server_version"]),
    }
    hook = DumpHook(dump_dir, meta,
                    max_queue=int(os.environ.get(ENV_QUEUE, "4")),
                    reserve_bytes=int(os.environ.get(ENV_RESERVE, str(1 << 30))))
    from sglang_patch.dump_writer import write_ready_marker

    write_ready_marker(dump_dir, info)
    log.info("hsfarm dump hook active: layers %s, dump dir %s", layers, dump_dir)
    return hook


def sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"


def around_logits_forward(original: Any, processor: Any, input_ids: Any, hidden_states: Any,
                          lm_head: Any, logits_metadata: Any, aux_hidden_states: Any = None,
                          *args: Any, **kwargs: Any) -> Any:
    """Dump our requests' rows, then run the LM head as usual."""
    if _hook is not None:
        _hook.on_logits(hidden_states, logits_metadata, aux_hidden_states)
    return original(processor, input_ids, hidden_states, lm_head, logits_metadata,
                    aux_hidden_states, *args, **kwargs)
