"""One export per destination at a time: an ``flock`` on ``DEST/.hsfarm-export.lock``.

Two exports into one DEST would each number files and append ledger lines from their own view
of it. The kernel drops an ``flock`` when its process dies however it dies, so a killed export
never leaves DEST locked; the file itself stays and only names the last holder.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from worker.core.errors import ConfigError

LOCK_NAME = ".hsfarm-export.lock"


@contextmanager
def dest_lock(dest: Path) -> Iterator[None]:
    """Hold DEST's export lock for the block.

    Raises:
        ConfigError: another export holds it (the message names that export).
    """
    fd = os.open(dest / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(f"another export into {dest} is running ({holder}); wait for it "
                              "to finish, then run this one again") from None
        me = (f"pid {os.getpid()} on {socket.gethostname()}, since "
              f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode() + b"\n", 0)
        yield
    finally:
        os.close(fd)  # releases the lock
