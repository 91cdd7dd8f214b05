"""What ``adopt``'s per-file check saw of a source file, pinned until the file is written: the
file's identity (device, inode, size, mtime) and the checksum of each array written from it."""

# The check reads each array once, a slice of rows at a time: every slice is copied, hashed
# (xxh3-128, the store's checksum) and the compared rows are taken from the copy, so the rows
# compared and the checksum are of the same bytes. The write opens the file again: another
# identity (another file renamed over it, a longer or newer one) is refused before anything is
# written, and bytes that are not the checksummed ones (rewritten in place, size and mtime kept)
# make the store abandon the file before its rename (``finalbytes.Part.expect_sum``). So a file
# is written with exactly the states its check saw, or not at all.
# Test:
# tests/farm/test_adopt_checks.py::test_a_source_file_changed_between_its_check_and_its_write_is_not_adopted  # noqa: E501

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_dump.dumpfile import T_AUX, T_AUX_SCALE, T_HIDDEN, T_HIDDEN_SCALE, T_INPUT_IDS
from producer.adopt.formats import Identity, SourceSample
from worker.core import checksums

SLICE_BYTES = 8 << 20  # read, hashed and searched for rows at a time
CHANGED = "changed since it was checked"


@dataclass(frozen=True)
class Pin:
    """One checked file: its identity, and each written tensor's checksum (its final name)."""

    identity: Identity | None
    sums: dict[str, str]

    def problem(self, s: SourceSample) -> str | None:
        """Why ``s`` (the file opened again to be written) is not the file checked, or None."""
        if self.identity != s.identity:
            return (f"{CHANGED} (another file at its path, or its size or mtime changed: "
                    f"{_what(self.identity)} then, {_what(s.identity)} now): not adopted")
        return None


def _what(i: Identity | None) -> str:
    return "unknown" if i is None else f"inode {i.inode}, {i.size_bytes} bytes, mtime {i.mtime_ns}"


def arrays(s: SourceSample) -> dict[str, np.ndarray]:
    """The arrays of ``s`` by the name of the tensor each is written as (scales: fp8 only)."""
    out = {T_INPUT_IDS: s.input_ids, T_HIDDEN: s.hidden, T_AUX: s.aux}
    if s.hidden_scale is not None and s.aux_scale is not None:
        out |= {T_HIDDEN_SCALE: s.hidden_scale, T_AUX_SCALE: s.aux_scale}
    return out


def take(s: SourceSample, rows: np.ndarray) -> tuple[Pin, dict[str, np.ndarray]]:
    """``s`` read once: its pin, and each of its arrays at ``rows`` (the same bytes hashed)."""
    sums, at = {}, {}
    for name, arr in arrays(s).items():
        if name == T_INPUT_IDS:
            sums[name] = checksums.of(np.asarray(arr, dtype="<i8"))
            continue
        sums[name], at[name] = hash_rows(arr, rows)
    return Pin(s.identity, sums), at


def hash_rows(arr: np.ndarray, rows: np.ndarray) -> tuple[str, np.ndarray]:
    """The checksum of ``arr``'s bytes (C order) and a copy of ``arr[rows]``, each slice of
    ``arr`` read once."""
    h = checksums.new_hasher()
    out = np.empty((len(rows), *arr.shape[1:]), dtype=arr.dtype)
    step = max(1, SLICE_BYTES // max(1, arr[:1].nbytes))
    for lo in range(0, len(arr), step):
        piece = np.array(arr[lo:lo + step])  # a copy: what is hashed is what rows come from
        h.update(piece.data.cast("B"))
        inside = (rows >= lo) & (rows < lo + step)
        out[inside] = piece[rows[inside] - lo]
    return h.hexdigest(), out
