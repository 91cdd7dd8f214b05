"""Kernel copies and reads from the device: the same bytes as the slow way, on real files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from worker import diskio

SIZES = [0, 1, 4095, 4096, 4097, (9 << 20) + 3]


@pytest.mark.parametrize("use_sendfile", [True, False])
def test_copy_range_appends_exactly_that_range(tmp_path: Path, use_sendfile: bool) -> None:
    # Given a source file and a destination that already holds a prefix
    data = os.urandom((9 << 20) + 123)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(data)
    with open(src, "rb") as s, open(dst, "wb") as d:
        d.write(b"head")
        d.flush()
        # When a range crossing chunk boundaries is copied, by the kernel or by chunks
        diskio.copy_range(s.fileno(), 17, len(data) - 20, d.fileno(), use_sendfile=use_sendfile)
    # Then the destination is the prefix and exactly that range
    assert dst.read_bytes() == b"head" + data[17:-3]


def test_copy_range_from_a_short_source_is_an_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100)
    with open(src, "rb") as s, open(tmp_path / "dst", "wb") as d:
        for use_sendfile in (True, False):
            with pytest.raises(OSError) as e:
                diskio.copy_range(s.fileno(), 50, 100, d.fileno(), use_sendfile=use_sendfile)
            assert e.value.errno == errno.EIO


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
