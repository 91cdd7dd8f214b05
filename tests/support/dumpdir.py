"""The dump-dir tests' user and paths: ``nobody`` to act as another user, and fresh dirs under
/dev/shm (world-writable, as in production) or on a disk file system that each test removes
again. Acting as another user takes root (CI runs as root): ``as_root`` skips otherwise.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user (setpriv to "
                             "nobody, chown): needs root, as CI runs; run the tests as root")


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


@pytest.fixture
def disk_sticky() -> Iterator[Path]:
    """A directory on a disk file system (under /var/tmp, which stays on disk where /tmp is a
    tmpfs) that everyone may write to, with the sticky bit (1777), as /tmp: another user can
    make a dir there, and remove only their own."""
    path = Path(f"/var/tmp/hsfarm-test-sticky-{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)
