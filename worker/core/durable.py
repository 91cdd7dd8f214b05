"""Durable writes: temp file → fsync → rename (or link) → fsync(dir), the one way a file of the
farm takes its name.

A crash leaves the old file or the new one, never a torn one: the bytes are on the device
before the name points at them, and the name is when the directory's fsync returns. Temp names
carry the writer's ``liveness.temp_tag`` after the temp mark, so cleanup can tell a dead
writer's temp file from a live one's. Tests: tests/state/test_durable.py."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from worker.core import diskio, outdir

fsync_dir = diskio.fsync_dir


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir_of(path: Path) -> None:
    """fsync the directory that holds (or held) ``path``: makes a rename or unlink durable."""
    fsync_dir(path.parent)


def commit(tmp: Path, final: Path) -> None:
    """fsync ``tmp``, rename it over ``final``, fsync the directory."""
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def commit_new(tmp: Path, final: Path) -> bool:
    """fsync ``tmp``, link it to ``final`` unless that exists (the first writer wins), remove
    ``tmp``, fsync the directory. Returns True when this writer's file is ``final``."""
    try:
        fsync_file(tmp)
        try:
            os.link(tmp, final)
            won = True
        except FileExistsError:
            won = False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(final.parent)
    return won


def write_bytes(final: Path, data: bytes) -> None:
    """``final`` holds ``data``, durably; no temp file is left when it fails."""
    tmp = outdir.temp_path(final)
    try:
        tmp.write_bytes(data)
        commit(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(final: Path, body: Any) -> None:
    """``final`` holds ``body`` as indented, key-sorted JSON, durably."""
    write_bytes(final, json.dumps(body, indent=1, sort_keys=True).encode())


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
