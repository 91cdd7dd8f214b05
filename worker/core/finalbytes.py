"""A final file's bytes: written from its parts in one pass, read back from the device in one.

The header goes first, sized for digests not known yet, and is rewritten in place last. Large
tensors come straight from the dump, a mapped window at a time (zero copy out of tmpfs); each
L2-sized piece is checksummed and NaN/Inf-checked while in cache, then written with its
writeback started, so the disk writes while the CPU goes on. Reading routes each tensor's bytes
to its hasher, with the algorithm its metadata names (``checksums``).
Test: tests/unit/test_store.py::test_parts_from_a_file_are_checked_and_checksummed_as_copied."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from worker.core import checksums, diskio, tensorfile
from worker.core.errors import Corrupt, NotAsHashed

PIECE_BYTES = 256 << 10  # checksummed and checked at a time: stays in L2


@dataclass(frozen=True)
class Part:
    """One tensor of a final file: dtype, shape, and where its bytes are.

    Either ``data`` (small tensors, in memory) or ``nbytes`` of the open file ``source`` (a
    dump) from ``offset``. ``check`` sees every piece of the bytes as they are copied (the
    value check). ``expect_sum``: the checksum the copied bytes must have (a writer that hashed
    them earlier, ``adopt``), compared before the file is final. A closed ``source`` raises on
    use, never reads a recycled descriptor.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview | None = None
    source: io.FileIO | None = None
    offset: int = 0
    check: Callable[[memoryview], None] | None = None
    expect_sum: str | None = None

    @classmethod
    def from_array(cls, dtype: str, arr: np.ndarray) -> Part:
        data = np.ascontiguousarray(arr, dtype=tensorfile.numpy_dtype(dtype)).tobytes()
        return cls(dtype, tuple(arr.shape), data=data)

    @property
    def nbytes(self) -> int:
        itemsize = tensorfile.numpy_dtype(self.dtype).itemsize
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize


def write_parts(fd: int, parts: dict[str, Part], metadata: dict[str, str],
                validate: Callable[[], None] | None = None) -> None:
    """Write a whole file at ``fd`` (empty, at position 0); checksums land in its metadata.

    ``validate`` runs after every byte went through the parts' checks, before the header is
    final: it raises to abandon the file (the caller deletes it).

    Raises:
        OSError: from the writes (ENOSPC included). Whatever ``validate`` raises.
        NotAsHashed: a part's bytes do not have its ``expect_sum``.
    """
    placeholder = dict.fromkeys(parts, "0" * checksums.DIGEST_HEX_LEN)
    head, header = _header(parts, metadata, placeholder)
    diskio.write_all(fd, head)
    sums = {}
    for name, offset, _ in header.file_ranges():
        sums[name] = _copy(parts[name], fd, offset)
        want = parts[name].expect_sum
        if want is not None and sums[name] != want:
            raise NotAsHashed(f"{name}'s bytes are not the ones hashed before (checksum "
                              f"{sums[name]}, expected {want})")
    if validate is not None:
        validate()
    final_head, _ = _header(parts, metadata, sums)
    if len(final_head) != len(head):
        raise ValueError("the header's size changed with its digests")
    diskio.pwrite_all(fd, final_head, 0)


def _header(parts: dict[str, Part], meta: dict[str, str],
            sums: Mapping[str, str]) -> tuple[bytes, tensorfile.Header]:
    return tensorfile.encode_header({k: (p.dtype, p.shape) for k, p in parts.items()},
                                    {**meta, **checksums.checksum_metadata(sums)})


def _copy(part: Part, fd: int, file_offset: int) -> str:
    """Append one part at ``fd`` (at ``file_offset``), a window at a time, each window's
    writeback started at once; returns its checksum."""
    h = checksums.new_hasher()
    if part.data is not None:
        windows: Iterator[memoryview] = _windows(part.data)
    elif part.source is not None:
        windows = diskio.mapped_windows(part.source.fileno(), part.offset, part.nbytes)
    else:
        raise ValueError("a Part needs data or a source")
    for window in windows:
        with window:  # released on every path, so the map can close
            for lo in range(0, len(window), PIECE_BYTES):
                with window[lo : lo + PIECE_BYTES] as piece:
                    h.update(piece)
                    if part.check is not None:
                        part.check(piece)
            diskio.write_all(fd, window)
            diskio.start_writeback(fd, file_offset, len(window))
            file_offset += len(window)
    return h.hexdigest()


def _windows(data: bytes | memoryview) -> Iterator[memoryview]:
    """Byte views of ``data``, ``diskio.MAP_WINDOW_BYTES`` at a time."""
    with memoryview(data) as whole, whole.cast("B") as view:
        for lo in range(0, len(view), diskio.MAP_WINDOW_BYTES):
            yield view[lo : lo + diskio.MAP_WINDOW_BYTES]


def read_back(path: Path, small: set[str]) -> tuple[
        tensorfile.Header, dict[str, str], dict[str, tensorfile.Tensor]]:
    """Read a file once from the device: its header, every tensor's checksum (with the
    algorithm its metadata names), and the tensors named in ``small`` as arrays.

    Raises:
        Corrupt: not a well-formed file (truncated included), or unknown checksums.
        FileNotFoundError: no such file.
    """
    with diskio.DiskReader(path) as reader:
        size, chunks = reader.size_bytes, reader.chunks()
        head, need = bytearray(), 8
        for _, view in chunks:  # the header: all in the first chunk but for odd files
            head += view
            if len(head) >= 8:
                need = 8 + tensorfile.header_length(bytes(head[:8]), size, path.name)
            if len(head) >= need:
                break
        need = 8 + tensorfile.header_length(bytes(head[:8]), size, path.name)
        header = tensorfile.parse_header(bytes(head[8:need]), size, path.name)
        try:
            algorithm, _ = checksums.file_checksums(header.metadata)
        except Corrupt as e:
            raise Corrupt(f"{path.name}: {e}") from e
        feed = _TensorFeed(header, algorithm, small)
        feed.add(0, memoryview(head))
        for offset, view in chunks:
            feed.add(offset, view)
        return header, feed.digests(), feed.small_tensors()


class _TensorFeed:
    """Routes a file's bytes, chunk by chunk, to each tensor's hasher (and keeps small ones)."""

    def __init__(self, header: tensorfile.Header, algorithm: str, small: set[str]) -> None:
        self.header = header
        self.ranges = header.file_ranges()
        self.hashers = {name: checksums.new_hasher(algorithm) for name, _, _ in self.ranges}
        self.small = {name: bytearray() for name in small if name in header.tensors}
        self.seen = 0

    def add(self, offset: int, view: memoryview) -> None:
        end = offset + len(view)
        for name, begin, nbytes in self.ranges:
            lo, hi = max(begin, offset), min(begin + nbytes, end)
            if lo < hi:
                piece = view[lo - offset : hi - offset]
                self.hashers[name].update(piece)
                if name in self.small:
                    self.small[name] += piece
        self.seen = max(self.seen, end)

    def digests(self) -> dict[str, str]:
        if self.seen != self.header.size_bytes:
            raise Corrupt(f"not a valid safetensors file: read {self.seen} bytes, header "
                          f"describes {self.header.size_bytes}")
        return {name: h.hexdigest() for name, h in self.hashers.items()}

    def small_tensors(self) -> dict[str, tensorfile.Tensor]:
        out = {}
        for name, raw in self.small.items():
            e = self.header.tensors[name]
            arr = np.frombuffer(bytes(raw), dtype=tensorfile.numpy_dtype(e.dtype)).reshape(e.shape)
            out[name] = tensorfile.Tensor(e.dtype, arr)
        return out
