"""Which SGLang launch layouts the dump hook handles, and what to change when it does not.

The hook reads per-token rows at ``LogitsProcessor.forward``, correct only when each rank
there holds all rows of its batch in order (TP, pipeline size 1; under DP attention each
group's attention-TP rank 0), every prefill runs eagerly (no prefill CUDA graph) and no prompt
is partly served from the prefix cache. Anything else is refused at model load, with the
flag that fixes it, as is a release older than ``SUPPORTED_SGLANG`` (it has no
``--enable-return-aux-hidden-states``). Test: tests/unit/test_sglang_layout.py.
"""

from __future__ import annotations

from typing import Any

# The releases the hook is tested with, oldest first (docs/sglang-live.md, "Supported SGLang
# releases"). 0.5.18-0.5.22 have the same plugin loader and hook targets but no
# --enable-return-aux-hidden-states: aux capture there needs an EAGLE-3 draft model.
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


def _release(version: str) -> tuple[int, ...]:
    """``"0.5.22.post1+cpu"`` → ``(0, 5, 22)``: the leading digits of the first three parts."""
    import re

    return tuple(int(m.group()) if (m := re.match(r"\d+", part)) else 0
                 for part in version.split("+")[0].split(".")[:3])


def version_problem(version: str) -> str | None:
    """Why the hook refuses this SGLang at start-up: a release older than the oldest supported
    one, whose launch flags cannot turn on target-only aux capture; None otherwise."""
    if not version or _release(version) >= _release(SUPPORTED_SGLANG[0]):
        return None
    return (f"SGLang {version} is not supported (supported: {', '.join(SUPPORTED_SGLANG)}): "
            f"releases before {SUPPORTED_SGLANG[0]} have no --enable-return-aux-hidden-states "
            f"(aux capture without a draft model); install sglang=={SUPPORTED_SGLANG[-1]}")


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
