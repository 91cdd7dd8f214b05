"""Kernel copies and reads from the device: the same bytes as the slow way, on real files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from worker.core import diskio

SIZES = [0, 1, 4095, 4096, 4097, (9 << 20) + 3]


def test_mapped_windows_cover_a_range_exactly_once(tmp_path: Path) -> None:
    # Given a file of 3 windows and a range starting off a page boundary
    data = os.urandom(3 * diskio.MAP_WINDOW_BYTES)
    path = tmp_path / "f"
    path.write_bytes(data)
    got = bytearray()
    with open(path, "rb") as f:
        for w in diskio.mapped_windows(f.fileno(), 100, len(data) - 103):
            with w:
                assert len(w) <= diskio.MAP_WINDOW_BYTES
                got += w
    # Then the windows, released in turn, are exactly that range
    assert bytes(got) == data[100:-3]
    assert str(path) not in Path("/proc/self/maps").read_text()  # nothing left mapped


def test_a_window_view_kept_too_long_fails_loudly(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 * diskio.MAP_WINDOW_BYTES))
    with open(path, "rb") as f:
        windows = diskio.mapped_windows(f.fileno(), 100, 3 * diskio.MAP_WINDOW_BYTES - 100)
        first = next(windows)
        assert bytes(first[:4]) == path.read_bytes()[100:104]
        # When the caller keeps a view of the first window and asks for the next
        # Then unmapping refuses (BufferError) instead of leaving a dangling view
        with pytest.raises(BufferError):
            next(windows)
        first.release()
        windows.close()


@pytest.mark.parametrize("direct", [False, True])
def test_disk_reader_returns_every_byte_once(tmp_path: Path, direct: bool) -> None:
    for size in SIZES:
        data = os.urandom(size)
        path = tmp_path / f"f{size}"
        path.write_bytes(data)
        with diskio.DiskReader(path, chunk_bytes=1 << 20, allow_direct=direct) as r:
            got = b"".join(bytes(v) for _, v in r.chunks())
            offsets = [off for off, _ in r.chunks()]
        assert got == data, size
        assert offsets == list(range(0, size, 1 << 20)) or (size == 0 and offsets == [])
    if direct and not r.direct:
        pytest.skip("this file system has no O_DIRECT: the fallback was tested")


def test_disk_reader_closes_its_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    before = len(os.listdir("/proc/self/fd"))
    with diskio.DiskReader(path) as r:
        list(r.chunks())
    with pytest.raises(FileNotFoundError):
        diskio.DiskReader(tmp_path / "missing")
    assert len(os.listdir("/proc/self/fd")) == before


def test_start_writeback_reaches_the_kernel(tmp_path: Path) -> None:
    # Given the libc binding (Linux): it takes a real descriptor and refuses a closed one
    import ctypes

    assert diskio._sync_file_range is not None
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"x" * (1 << 20))
        f.flush()
        fd = f.fileno()
        assert diskio._sync_file_range(fd, 0, 0, 2) == 0
        diskio.start_writeback(fd)
    assert diskio._sync_file_range(fd, 0, 0, 2) == -1
    assert ctypes.get_errno() == errno.EBADF
