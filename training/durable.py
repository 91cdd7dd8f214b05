"""Durable writes for the training side: temp → fsync → rename → fsync(dir), as the store does.

Temp names carry the writer's ``liveness.temp_tag`` after the farm's temp mark, so the store's
cleanup (and a resumed export) can tell a dead writer's temp file from a live one's.
"""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path

from sglang_patch import contracts as c
from worker.core import diskio, liveness
from worker.core.store import fsync_dir


def tmp_for(final: Path) -> Path:
    """A temp path beside ``final``."""
    tag = liveness.temp_tag(uuid.uuid4().hex[:8])  # as the store's temps
    return final.with_name(f".{final.name}{c.TMP_MARK}{tag}")


class WritebackFile(io.FileIO):
    """A new file for writing whose every write is handed to the device at once
    (``diskio.start_writeback``), so the device writes while the writer computes the next
    piece and the final fsync finds little left to do."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "wb")
        self.written_bytes = 0

    def write(self, data: object, /) -> int:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            done += super().write(view[done:]) or 0
        diskio.start_writeback(self.fileno(), self.written_bytes, done)
        self.written_bytes += done
        return done


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def commit(tmp: Path, final: Path) -> None:
    """fsync ``tmp``, rename it over ``final``, fsync the directory."""
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def advise(path: Path, advice: int) -> None:
    """``posix_fadvise`` over the whole file (``os.POSIX_FADV_*``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    finally:
        os.close(fd)


def drop_cache(path: Path) -> None:
    """Evict a (synced) file's pages, so the next read comes from the disk."""
    advise(path, os.POSIX_FADV_DONTNEED)


def fsync_dir_of(path: Path) -> None:
    """fsync the directory that holds (or held) ``path``: makes a rename or unlink durable."""
    fsync_dir(path.parent)
