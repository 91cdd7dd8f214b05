"""The fp8 tests' measure of error: relative L2 error per token and captured layer."""

from __future__ import annotations

import torch


def rel_err(x: torch.Tensor, y: torch.Tensor, layers: int) -> torch.Tensor:
    """|x - y| / |x| (L2 over each layer's row): [T, layers]; 0 where x is 0."""
    a, b = x.view(x.shape[0], layers, -1), y.view(y.shape[0], layers, -1)
    return (a - b).norm(dim=2) / a.norm(dim=2).clamp_min(1e-30)
