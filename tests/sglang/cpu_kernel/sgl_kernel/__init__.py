"""A test-only stand-in for ``sgl_kernel`` on a CPU without AMX: NOT SGLang's kernel library.

SGLang 0.5.23 with ``SGLANG_USE_CPU_ENGINE=1`` imports a few ``*_cpu`` names from
``sgl_kernel`` at import time, and PyPI has no CPU build of it (``sgl-kernel`` and
``sglang-kernel`` are CUDA builds). On a CPU without AMX, with ``--attention-backend
torch_native``, a prefill/decode run calls exactly one of them:
``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``), implemented here in
torch with the semantics of SGLang's triton ``assign_req_to_token_pool``. Every other name
exists only so that ``from sgl_kernel import X`` succeeds, and raises if it is ever called.

Used only by the live-server tests (``tests/live/``), put on the server's ``PYTHONPATH`` by
them. No torch op is registered, so SGLang's AMX checks (``torch.ops.sgl_kernel.*``) stay off.
"""

from __future__ import annotations

from typing import Any

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request row b: ``req_to_token[idx[b], start[b]:end[b]]`` = its slice of
    ``out_cache_loc`` (the slices are packed back to back, in row order)."""
    del pool_len  # the row stride; torch indexing knows it
    out = 0
    for b in range(req_pool_indices.shape[0]):
        start, end = int(start_offset[b]), int(end_offset[b])
        n = end - start
        req_to_token[int(req_pool_indices[b]), start:end] = out_cache_loc[out : out + n]
        out += n


def _not_here(name: str) -> Any:
    def missing(*_: Any, **__: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name}: not in the CPU test stand-in "
                                  "(tests/sglang/cpu_kernel); this code path needs the real "
                                  "kernel library")

    missing.__name__ = name
    return missing


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _not_here(name)
