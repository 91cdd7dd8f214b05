"""Durable writes: temp file → fsync → rename (or link) → fsync(dir), the one way a file of the
farm takes its name.

A crash leaves the old file or the new one, never a torn one: the bytes are on the device
before the name points at them, and the name is when the directory's fsync returns. Temp names
carry the writer's ``liveness.temp_tag`` after the temp mark (``outdir.temp_path``), so
cleanup can tell a dead writer's temp file from a live one's; a file set aside goes by ``move``;
the fsyncs are ``diskio``'s. Tests: tests/state/test_durable.py, tests/unit/test_durable.py."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from worker.core import diskio, outdir


def commit(tmp: Path, final: Path) -> None:
    """fsync ``tmp``, rename it over ``final``, fsync the directory."""
    diskio.fsync_file(tmp)
    commit_synced(tmp, final)


def commit_synced(tmp: Path, final: Path) -> None:
    """Rename ``tmp``, already on the device (its writer fsynced it), over ``final``, then
    fsync the directory."""
    os.replace(tmp, final)
    diskio.fsync_dir(final.parent)


def commit_new(tmp: Path, final: Path) -> bool:
    """fsync ``tmp``, link it to ``final`` unless that exists (the first writer wins), remove
    ``tmp``, fsync the directory. Returns True when this writer's file is ``final``."""
    try:
        diskio.fsync_file(tmp)
        try:
            os.link(tmp, final)
            won = True
        except FileExistsError:
            won = False
    finally:
        tmp.unlink(missing_ok=True)
    diskio.fsync_dir(final.parent)
    return won


def move(src: Path, dest: Path) -> None:
    """Rename ``src`` to ``dest`` (one file system; a file set aside, not a new one), then fsync
    both directories: after a crash the file is at one of the two names, never lost."""
    os.replace(src, dest)
    diskio.fsync_dir(dest.parent)
    diskio.fsync_dir(src.parent)


def remove(path: Path, missing_ok: bool = False) -> None:
    """Unlink ``path``, then fsync its directory: the removal is on the device when it returns."""
    path.unlink(missing_ok=missing_ok)
    diskio.fsync_dir(path.parent)


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
    write_bytes(final, _json_bytes(body))


def write_new_bytes(final: Path, data: bytes) -> bool:
    """``final`` holds ``data`` unless another writer's file took the name first (it wins,
    ``commit_new``); durably, and no temp file is left. True when this writer's file is it."""
    tmp = outdir.temp_path(final)
    try:
        tmp.write_bytes(data)
        return commit_new(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_new_json(final: Path, body: Any) -> bool:
    """``write_new_bytes`` of ``body`` as ``write_json`` writes it."""
    return write_new_bytes(final, _json_bytes(body))


def _json_bytes(body: Any) -> bytes:
    return json.dumps(body, indent=1, sort_keys=True).encode()


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
