"""The per-process dump hook: turns SGLang's ForwardBatch into the collector's batch layout.

Filters cheaply before touching any tensor: only extend (prefill) passes, never target-verify
passes or CUDA-graph capture, and only batches that contain at least one of our rids.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from engine_dump.dump_writer import DumpCollector, DumpWriter, Failed
from engine_dump.dumpfile import DTYPE_BF16
from engine_dump.rids import parse_rid

log = logging.getLogger("hsfarm.sglang_hook")


class DumpHook:
    """Owns the collector and the writer thread of one scheduler process (attn-TP rank 0)."""

    def __init__(self, dump_dir: Path, metadata: dict[str, str], max_queue: int = 4,
                 reserve_bytes: int = 1 << 30, ttl_s: float = 600.0,
                 dtype: str = DTYPE_BF16) -> None:
        self.writer = DumpWriter(dump_dir, metadata, max_queue=max_queue,
                                 min_free_bytes=reserve_bytes, dtype=dtype)
        self.ttl_s = ttl_s
        self.collector: DumpCollector | None = None  # stager chosen on first tensors

    def on_logits(self, hidden_states: Any, forward_batch: Any, aux_hidden_states: Any) -> None:
        rids = our_rids(forward_batch)
        if not rids:
            return
        if aux_hidden_states is None:
            for rid in rids:
                if parse_rid(rid) is not None:
                    self.writer.submit(Failed(rid, "no aux hidden states: launch with "
                                              "--enable-return-aux-hidden-states"))
            return
        from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

        aux = pack_aux_hidden_states(aux_hidden_states)
        if self.collector is None:
            from engine_dump.cuda_stager import stager_for

            self.collector = DumpCollector(self.writer, stager=stager_for(hidden_states),
                                           ttl_s=self.ttl_s)
        self.collector.on_forward(
            rids=rids,
            prefix_lens=forward_batch.extend_prefix_lens_cpu,
            extend_lens=forward_batch.extend_seq_lens_cpu,
            input_ids=forward_batch.input_ids,
            hidden=hidden_states,
            aux=aux,
        )


def our_rids(fb: Any) -> list[str]:
    """The batch's rids if it is a prefill pass holding one of ours, else []."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    if not isinstance(fb, ForwardBatch):
        return []  # LogitsMetadata passed directly: not a model forward of a batch
    mode = fb.forward_mode
    if mode is None or not mode.is_extend() or mode.is_target_verify():
        return []
    rids = fb.rids or []
    if not any(parse_rid(r) is not None for r in rids):
        return []
    from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

    if get_is_capture_mode():
        return []
    if fb.extend_seq_lens_cpu is None or fb.extend_prefix_lens_cpu is None:
        log.error("extend batch without CPU lengths; cannot dump %s", rids)
        return []
    return list(rids)
