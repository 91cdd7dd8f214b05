"""Asynchronous device-to-host copies for the dump hook: pinned memory, a side stream, an event.

The forward only enqueues: the side stream waits for the compute stream (the rows are final),
runs any ``encode`` (fp8), copies into pinned buffers with ``non_blocking=True`` and records
an event that the writer thread waits on, never the forward. The sources are marked as used by
the side stream, so the caching allocator does not hand their memory to the next layer before
the copy read it; pinned buffers come from PyTorch's caching host allocator.
Tests: tests/live/test_live_fp8.py (on a GPU).
"""

from __future__ import annotations

import torch

from engine_dump.dump_writer import CpuStager, Encode, Stager


class _CudaStaged:
    def __init__(self, host: list[torch.Tensor], event: torch.cuda.Event) -> None:
        self.host = host
        self.event = event

    def wait(self) -> list[torch.Tensor]:
        self.event.synchronize()
        return self.host


class CudaStager:
    """Stages GPU tensors into pinned host memory on a dedicated stream."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(device=self.device)

    def stage(self, tensors: list[torch.Tensor], encode: Encode | None = None) -> _CudaStaged:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        host = []
        with torch.cuda.stream(self.stream):
            for t in tensors:
                t.record_stream(self.stream)  # read on this stream (by encode or the copy)
            for t in encode(tensors) if encode is not None else tensors:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                host.append(buf)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _CudaStaged(host, event)


def stager_for(tensor: torch.Tensor) -> Stager:
    """The right stager for where ``tensor`` lives."""
    if tensor.is_cuda:
        return CudaStager(tensor.device)
    return CpuStager()
