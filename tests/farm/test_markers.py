"""A ready marker of a live process in another pid namespace (``unshare``) is never removed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_dump import contracts as c
from engine_dump import markers as mk
from tests.support.markers import WRITE


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare(1) and root for a new pid namespace")
def test_a_live_marker_of_another_pid_namespace_is_never_removed(tmp_path: Path) -> None:
    # Given a live server process in another pid namespace (a container sharing the dump
    # dir) whose pid here would name some other process, or none
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                             "-c", WRITE, str(tmp_path), "30"], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout is not None
        pid_there = int(proc.stdout.readline())
        marker = tmp_path / f"{c.READY_PREFIX}{pid_there}"
        # When a server starting here removes stale markers
        mk.remove_dead(tmp_path)
        # Then its marker stays, judged unknown, not dead
        [m] = mk.markers(tmp_path)
        assert m.path == marker and m.state == mk.UNKNOWN
        assert "another pid namespace" in m.why
    finally:
        proc.kill()
        proc.wait()
