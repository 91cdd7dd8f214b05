"""float8 e4m3 storage of hidden states: a float32 scale per block of values (torch, hook side).

``quantize`` runs on the copy's side stream on a GPU, so the compute stream waits only for its
own work (costs: docs/fp8.md). Each layer's row of a token is cut into blocks of
``dumpfile.FP8_BLOCK`` values, ``scale = max|block| / 448`` (e4m3fn's largest finite value):
nothing saturates and a massive channel coarsens only its own block; a zero block gets the
smallest positive scale, a NaN or Inf a non-finite one, which the worker refuses.
Test: tests/unit/test_fp8.py::test_round_trip_error_is_within_e4m3s_bounds_and_the_codecs_agree
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_dump import dumpfile

FP8 = torch.float8_e4m3fn
FP8_MAX = dumpfile.FP8_MAX
_TINY = torch.finfo(torch.float32).tiny


def quantize(x: torch.Tensor, layers: int, block: int = dumpfile.FP8_BLOCK
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` [T, layers*H] (any float dtype) -> (uint8 [T, layers*H], float32
    [T, layers*ceil(H/block)]).

    The uint8 tensor holds the float8 e4m3fn bits (a view, so concatenation and the copy to the
    host handle it as plain bytes). ``block`` = H writes one scale per token per layer (the
    per-row layout; benchmarks compare it). Works layer by layer: the float32
    temporary is [T, H] (padded to whole blocks).
    """
    t, width = x.shape
    h = width // layers
    nb = dumpfile.fp8_blocks(h, block)
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
    [T, layers*H]; blocks of ``dumpfile.FP8_BLOCK`` values, or one scale per row (the
    per-row layout, still read). Raises ValueError for any other scale shape."""
    t, width = q.shape
    h = width // layers
    nb = scale.shape[1] // layers
    if scale.shape[1] != layers * nb:
        raise ValueError(f"{scale.shape[1]} scales per token for {layers} layers")
    block = dumpfile.fp8_block_of(h, nb)
    v = q.view(FP8).float().view(t, layers, h)
    if nb * block != h:
        v = F.pad(v, (0, nb * block - h))
    v = v.view(t, layers, nb, block) * scale.view(t, layers, nb, 1)
    return v.view(t, layers, nb * block)[:, :, :h].reshape(t, width).to(dtype)
