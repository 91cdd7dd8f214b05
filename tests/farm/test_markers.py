"""Ready markers: which are dead (this boot, this pid namespace, the process gone or its pid
reused), and that only those are ever removed. Real processes write every marker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_patch import contracts as c
from sglang_patch import markers as mk

WRITE = ("import os, sys, time; from pathlib import Path; "
         "from sglang_patch.markers import write_ready_marker; "
         "write_ready_marker(Path(sys.argv[1]), {'layers_to_capture': [2, 30, 58]}); "
         "print(os.getpid(), flush=True); time.sleep(float(sys.argv[2]))")


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
