"""Which SGLang launch layouts the dump hook handles, and what to change when it does not.

The hook reads per-token rows at ``LogitsProcessor.forward``, correct only when each rank
there holds all rows of its batch in order (TP, pipeline size 1; under DP attention each
group's attention-TP rank 0), every prefill runs eagerly (no prefill CUDA graph) and no prompt
is partly served from the prefix cache. Anything else is refused at model load, with the
flag that fixes it. Attributes of SGLang 0.5.23's ``ServerArgs`` are read defensively, so
another version fails ``verify`` with a message. Test: tests/sglang/test_plugin.py.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_SGLANG = ("0.5.23",)


class LayoutError(RuntimeError):
    """The server was launched with options the dump hook cannot handle correctly."""


def sglang_version() -> str:
    """The installed SGLang's version, from its package metadata; "" when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return ""

# The launch flags extraction needs, as a user types them (checked against SGLang's parser by
# ``python -m sglang_patch verify``).
REQUIRED_FLAGS = [
    "--disable-radix-cache",
    "--disable-prefill-cuda-graph",
    "--enable-return-aux-hidden-states",
    "--speculative-algorithm", "EAGLE3",
]


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def layout_problems(args: Any) -> list[str]:
    """Everything about ``args`` (a ServerArgs) the hook cannot handle; each names its fix."""
    out = []
    if (_get(args, "pp_size", 1) or 1) > 1:
        out.append("pipeline parallelism (--pp-size > 1): aux states exist only on the last "
                   "stage; use --pp-size 1")
    if _get(args, "enable_two_batch_overlap", False):
        out.append("two-batch overlap skips aux capture past the dense layers; drop "
                   "--enable-two-batch-overlap")
    for flag in ("enable_attn_tp_input_scattered", "enable_layernorm_sp"):
        if _get(args, flag, False):
            out.append(f"--{flag.replace('_', '-')} shards rows across ranks at the LM head; "
                       "drop it")
    prefill_graph_off = (_get(args, "disable_cuda_graph", False)
                         or _get(args, "disable_prefill_cuda_graph", False)
                         or _get(args, "cuda_graph_backend_prefill") == "disabled")
    if not prefill_graph_off:
        out.append("prefill CUDA graphs replay without running Python hooks; add "
                   "--disable-prefill-cuda-graph")
    if not _get(args, "disable_radix_cache", False):
        out.append("the radix (prefix) cache skips computing cached rows; add "
                   "--disable-radix-cache")
    if not _get(args, "enable_return_aux_hidden_states", False):
        out.append("aux hidden-state capture is off; add --enable-return-aux-hidden-states "
                   "--speculative-algorithm EAGLE3 [--return-aux-hidden-state-layer-ids ...]")
    capture = _get(args, "aux_hidden_state_capture")
    if capture not in (None, "EAGLE3", "eagle3") and "EAGLE3" not in str(capture).upper():
        out.append(f"aux capture convention is {capture}; this farm writes EAGLE-3 data: "
                   "use --speculative-algorithm EAGLE3")
    return out
