"""float8 e4m3 storage of hidden states: one scale per token per layer (torch, hook side).

``quantize`` runs where the hook hands rows over for the copy to the host: on a GPU, on the
copy's side stream, so the compute stream only waits for its own work, and the host, tmpfs and
the worker then move half the bytes. On a GPU it reads 2 bytes and writes ~1 per value (a few
elementwise kernels over one chunk: tens of microseconds for 2k tokens of Kimi-K2.5); on CPU
(the reference server) it costs ~0.5 s per 2k tokens at H = 7168 (docs/fp8.md).

``scale = max|x| / 448`` per row of each layer (448: e4m3fn's largest finite value), so every
value maps into range and none saturates; a row of zeros gets the smallest positive scale. A
NaN or Inf in a row makes its scale non-finite, which the worker refuses, as it refuses NaN/Inf
in bf16.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_TINY = torch.finfo(torch.float32).tiny


def quantize(x: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` [T, layers*H] (any float dtype) -> (uint8 [T, layers*H], float32 [T, layers]).

    The uint8 tensor holds the float8 e4m3fn bits (a view, so concatenation and the copy to the
    host handle it as plain bytes). Works layer by layer: the float32 temporary is [T, H].
    """
    t, width = x.shape
    h = width // layers
    q = torch.empty((t, width), dtype=torch.uint8, device=x.device)
    scale = torch.empty((t, layers), dtype=torch.float32, device=x.device)
    for i in range(layers):
        v = x[:, i * h:(i + 1) * h]
        s = v.abs().amax(dim=1, keepdim=True).float().div_(FP8_MAX).clamp_(min=_TINY)
        scale[:, i:i + 1] = s
        # (v / s: a new float32 tensor, never an in-place change of the caller's rows)
        q[:, i * h:(i + 1) * h] = (v / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 (e4m3fn bits) [T, L*H] and float32 scales [T, L] -> ``dtype`` [T, L*H]."""
    t, width = q.shape
    layers = scale.shape[1]
    v = q.view(FP8).float().view(t, layers, width // layers) * scale[:, :, None]
    return v.view(t, width).to(dtype)
