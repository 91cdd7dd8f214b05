"""fp8 runs on the training side: float8 e4m3 hidden states and their scales back to bf16.

Every trainer reads bf16 (speculators 0.9.0 has no fp8 path), so the loader and ``export``
hand out ``float(q) * scale`` (per block of a row, or per row: the scales' shape says which)
rounded to bf16 as torch rounds, the same bytes on every machine. Checksums cover the stored
fp8 bytes and are checked before dequantizing; an export's ledger keeps the bf16 tensors'
checksums (``as_exported``), so a later run checks them again without dequantizing.
Test: tests/farm/test_fp8.py::test_an_fp8_run_end_to_end_read_by_the_training_side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from engine_dump.dumpfile import AUX_LAYERS, T_AUX, T_AUX_SCALE, T_HIDDEN, T_HIDDEN_SCALE
from training.manifest import RunInfo
from training.sample_file import SampleFile
from worker.core import checksums
from worker.core.errors import Corrupt

_PAIRS = ((T_HIDDEN, T_HIDDEN_SCALE, 1), (T_AUX, T_AUX_SCALE, AUX_LAYERS))
STORED = (T_HIDDEN, T_HIDDEN_SCALE, T_AUX, T_AUX_SCALE)


def to_bf16(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A sample's arrays with ``hidden_state`` and ``aux_hidden_state`` as bf16 (uint16 bits,
    as bf16 runs hold them) and the scales dropped; other tensors as they are."""
    import torch  # here: the producer CLI imports export without torch (a worker host)

    from engine_dump import fp8 as codec

    out = {k: v for k, v in arrays.items() if k not in (T_HIDDEN_SCALE, T_AUX_SCALE)}
    for name, scale, layers in _PAIRS:
        q = torch.from_numpy(np.ascontiguousarray(arrays[name]))
        s = torch.from_numpy(np.ascontiguousarray(arrays[scale]))
        out[name] = codec.dequantize(q, s, layers=layers).view(torch.int16).numpy().view(np.uint16)
    return out


def as_exported(info: RunInfo, arrays: Mapping[str, np.ndarray],
                src_sums: checksums.Recorded) -> tuple[dict[str, np.ndarray],
                                                       checksums.Recorded]:
    """What an export writes from a source file, and the checksums its outputs must match.

    A bf16 run: the arrays and the file's own checksums. An fp8 run: the stored tensors are
    checked against the file's checksums first (Corrupt names a mismatch), then dequantized;
    the checksums are the file's with the bf16 tensors' in place of the stored ones.
    """
    if not info.fp8:
        return dict(arrays), src_sums
    bad = checksums.mismatches(src_sums, {k: arrays[k] for k in STORED})
    if bad:
        raise Corrupt(f"source checksum of {', '.join(bad)}")
    out = to_bf16(arrays)
    sums = {k: v for k, v in src_sums.sums.items() if k not in STORED}
    sums.update({name: checksums.of(out[name]) for name, _, _ in _PAIRS})
    return out, checksums.Recorded(checksums.DEFAULT_ALGORITHM, sums)


def exported_bytes(info: RunInfo, path: Path) -> int:
    """About what an export of the file at ``path`` writes: its size, an fp8 run's with its
    states in bf16 (2 bytes a value, no scales: ~1.9x). A header that cannot be read counts
    as its size (the export fails that file)."""
    size = path.stat().st_size
    if not info.fp8:
        return size
    try:
        entries = SampleFile.open(path).entries
    except (Corrupt, OSError):
        return size
    stored = sum(entries[k].end - entries[k].start for k in STORED if k in entries)
    values = sum(math.prod(entries[k].shape) for k in (T_HIDDEN, T_AUX) if k in entries)
    return size - stored + 2 * values
