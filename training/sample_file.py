"""One output file, opened by its header: per-tensor reads and memory maps, no whole read.

The safetensors layout is an 8-byte little-endian header length, a JSON header (names →
dtype, shape, byte offsets; ``__metadata__``), then the data. Opening reads only the header;
``read`` reads one tensor's bytes (ids and masks: a few KB); ``map_all`` maps the file
copy-on-write and ``read_all`` reads it in one pass, so a loader hands its tensors out without
a copy on disk.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine_dump import header_codec
from worker.core.errors import Corrupt

# safetensors dtype tag -> numpy dtype holding the raw bytes (bf16 as uint16)
NP_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype("u1")}  # float8 e4m3fn bits (fp8 runs: training.fp8 dequantizes)


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes lie in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


@dataclass(frozen=True)
class SampleFile:
    """A safetensors file's header: metadata and tensor entries."""

    path: Path
    metadata: dict[str, str]
    entries: dict[str, Entry]
    size_bytes: int

    @classmethod
    def open(cls, path: Path) -> SampleFile:
        """Read and check the header only. Raises Corrupt or OSError."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = header_codec.length(f.read(8))
            if n < 2 or not header_codec.plausible(n, size):
                raise Corrupt(f"{path}: not a safetensors file (header length {n})")
            try:
                header, raw_meta = header_codec.decode(f.read(n))
            except ValueError as e:
                raise Corrupt(f"{path}: unreadable safetensors header: {e}") from e
        meta = dict(raw_meta)
        entries = {name: _entry(path, name, e, 8 + n, size) for name, e in header.items()}
        return cls(path, meta, entries, size)

    def read(self, name: str) -> np.ndarray:
        """One tensor's bytes, read from the file (bf16 as uint16)."""
        e = self.entry(name)
        with open(self.path, "rb") as f:
            f.seek(e.start)
            raw = f.read(e.end - e.start)
        if len(raw) != e.end - e.start:
            raise Corrupt(f"{self.path}: {name} cut short")
        return np.frombuffer(raw, NP_DTYPES[e.dtype]).reshape(e.shape)

    def map_all(self, prefetch: bool = False) -> dict[str, np.ndarray]:
        """Every tensor, over one private (copy-on-write) map of the file, never written back:
        pages are read from the disk only when touched; with ``prefetch``, a background thread
        asks for the whole file at once (``_read_ahead``: read ahead in file order while the
        caller reads the first pages)."""
        if self.size_bytes == 0:
            return {}
        with open(self.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), self.size_bytes, access=mmap.ACCESS_COPY)
            if prefetch:
                threading.Thread(target=_read_ahead, args=(os.dup(f.fileno()), self.size_bytes),
                                 name="hsfarm-read-ahead", daemon=True).start()
        return self._arrays(mm)

    def read_all(self) -> dict[str, np.ndarray]:
        """Every tensor, over one buffer filled by one sequential read of the file (a file read
        once and dropped: export's check of a skipped source before deleting it; the loader and
        the export's sources map the file instead, ``map_all``). Raises Corrupt if the file is
        shorter than its header says."""
        buf = bytearray(self.size_bytes)
        with open(self.path, "rb", buffering=0) as f:
            n = f.readinto(buf)
        if n != self.size_bytes:
            raise Corrupt(f"{self.path}: read {n} of {self.size_bytes} bytes")
        return self._arrays(buf)

    def _arrays(self, buf: mmap.mmap | bytearray) -> dict[str, np.ndarray]:
        return {name: np.frombuffer(buf, NP_DTYPES[e.dtype], count=_count(e), offset=e.start)
                .reshape(e.shape) for name, e in self.entries.items()}

    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise Corrupt(f"{self.path}: no tensor {name!r}") from None


def _read_ahead(fd: int, size: int) -> None:
    """Ask for the first ``size`` bytes of ``fd`` (``POSIX_FADV_WILLNEED``), then close it.

    In a thread of its own: the advice returns only when the reads of the whole file are
    submitted, on a shallow device queue nearly the whole read, so inline the caller's first
    touch of the map waited for all of it. Measured against a plain read of the same files,
    each pair's order alternating (docs/benchmarks.md, "The loader's read-ahead"): inline
    0.80-0.96x, from a thread 1.02x at 86 and 470 MB. Mapping the pages in ahead of the
    caller as well (``MADV_POPULATE_READ``) was tried: 0.83x at 86 MB, dropped."""
    try:
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def _count(e: Entry) -> int:
    return int(np.prod(e.shape, dtype=np.int64))


def _entry(path: Path, name: str, e: dict[str, object], data_start: int, size: int) -> Entry:
    try:
        dtype, shape = str(e["dtype"]), tuple(int(d) for d in e["shape"])  # type: ignore[attr-defined]
        start, end = (data_start + int(o) for o in e["data_offsets"])  # type: ignore[attr-defined]
    except (KeyError, TypeError, ValueError) as err:
        raise Corrupt(f"{path}: bad header entry for {name}: {err}") from err
    if dtype not in NP_DTYPES:
        raise Corrupt(f"{path}: tensor {name} has unsupported dtype {dtype}")
    want = int(np.prod(shape, dtype=np.int64)) * NP_DTYPES[dtype].itemsize
    if end - start != want or end > size or start < data_start:
        raise Corrupt(f"{path}: tensor {name} spans bytes {start}..{end} of {size}, "
                      f"expected {want} bytes")
    return Entry(dtype, shape, start, end)
