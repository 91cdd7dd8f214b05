"""The dump-dir tests' user and paths: ``nobody`` to act as another user, and fresh dirs under
/dev/shm (world-writable, as in production) that each test removes again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A path under /dev/shm (world-writable, as in production) that nothing holds yet."""
    path = Path(f"/dev/shm/hsfarm-test-dumpdir-{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_parent() -> Iterator[Path]:
    """A directory under /dev/shm for a dump dir to sit in, made by root (0755)."""
    path = Path(f"/dev/shm/hsfarm-test-parent-{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
