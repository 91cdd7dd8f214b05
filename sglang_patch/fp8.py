"""float8 e4m3 storage of hidden states: a float32 scale per block of values (torch, hook side).

``quantize`` runs where the hook hands rows over for the copy to the host: on a GPU, on the
copy's side stream, so the compute stream only waits for its own work, and the host, tmpfs and
the worker then move half the bytes. On a GPU it reads 2 bytes and writes ~1 per value (a few
elementwise kernels over one chunk: tens of microseconds for 2k tokens of Kimi-K2.5); on CPU
(the reference server) it costs ~0.5 s per 2k tokens at H = 7168 (docs/fp8.md).

Each layer's row of a token is cut into blocks of ``contracts.FP8_BLOCK`` values (the last one
shorter when H is not a multiple); ``scale = max|block| / 448`` (448: e4m3fn's largest finite
value), so every value maps into range and none saturates, and a massive channel coarsens
only its own block; a block of zeros gets the smallest positive scale. A NaN or Inf in a block
makes its scale non-finite, which the worker refuses, as it refuses NaN/Inf in bf16.
``dequantize`` also reads one scale per token per layer (files written before the blocks:
a block of the whole row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_patch import contracts as c

FP8 = torch.float8_e4m3fn
FP8_MAX = c.FP8_MAX
_TINY = torch.finfo(torch.float32).tiny


def quantize(x: torch.Tensor, layers: int, block: int = c.FP8_BLOCK
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` [T, layers*H] (any float dtype) -> (uint8 [T, layers*H], float32
    [T, layers*ceil(H/block)]).

    The uint8 tensor holds the float8 e4m3fn bits (a view, so concatenation and the copy to the
    host handle it as plain bytes). ``block`` = H writes one scale per token per layer (the
    layout before the blocks; benchmarks compare it). Works layer by layer: the float32
    temporary is [T, H] (padded to whole blocks).
    """
    t, width = x.shape
    h = width // layers
    nb = c.fp8_blocks(h, block)
    q = torch.empty((t, width), dtype=torch.uint8, device=x.device)
    scale = torch.empty((t, layers * nb), dtype=torch.float32, device=x.device)
    for i in range(layers):
        # (a new float32 tensor, never an in-place change of the caller's rows)
        v = F.pad(x[:, i * h:(i + 1) * h].to(torch.float32, copy=True), (0, nb * block - h))
        blocks = v.view(t, nb, block)
        s = blocks.abs().amax(dim=2).div_(FP8_MAX).clamp_(min=_TINY)
        scale[:, i * nb:(i + 1) * nb] = s
        blocks.div_(s[:, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        q[:, i * h:(i + 1) * h] = v[:, :h].to(FP8).view(torch.uint8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
               layers: int) -> torch.Tensor:
    """uint8 (e4m3fn bits) [T, layers*H] and float32 scales [T, layers*blocks] -> ``dtype``
    [T, layers*H]; blocks of ``contracts.FP8_BLOCK`` values, or one scale per row (files
    written before the blocks). Raises ValueError for any other scale shape."""
    t, width = q.shape
    h = width // layers
    nb = scale.shape[1] // layers
    if scale.shape[1] != layers * nb:
        raise ValueError(f"{scale.shape[1]} scales per token for {layers} layers")
    block = c.fp8_block_of(h, nb)
    v = q.view(FP8).float().view(t, layers, h)
    if nb * block != h:
        v = F.pad(v, (0, nb * block - h))
    v = v.view(t, layers, nb, block) * scale.view(t, layers, nb, 1)
    return v.view(t, layers, nb * block)[:, :, :h].reshape(t, width).to(dtype)
