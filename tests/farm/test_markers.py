"""A ready marker of a live process in another pid namespace (``unshare``) is never removed;
two servers sharing a dump dir: each worker and ``verify`` reads its own server's markers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_dump import markers as mk
from engine_dump.dumpfile import DTYPE_BF16, DTYPE_FP8, READY_PREFIX
from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import CACHE, FarmFactory, wait_finished
from tests.support.faults import enqueue
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
        marker = tmp_path / f"{READY_PREFIX}{pid_there}"
        # When a server starting here removes stale markers
        mk.remove_dead(tmp_path)
        # Then its marker stays, judged unknown, not dead
        [m] = mk.markers(tmp_path)
        assert m.path == marker and m.state == mk.UNKNOWN
        assert "another pid namespace" in m.why
    finally:
        proc.kill()
        proc.wait()


def _verify(dump_dir: Path, port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sglang_patch", "verify", "--live-only",
                           "--dump-dir", str(dump_dir), "--server", f"http://127.0.0.1:{port}",
                           "--timeout-s", "20"], capture_output=True, text=True, timeout=120)


def test_two_servers_sharing_a_dump_dir_each_worker_reads_its_own_marker(
        farm_factory: FarmFactory, tmp_path: Path) -> None:
    # Given server A (bf16, 2 DP groups) and server B (fp8, started later: the newest live
    # marker of the dir) writing into one dump dir, as the RUNBOOK allows
    a = farm_factory("a", server_args=["--attn-dp-size", "2"])
    b = LocalFarm(tmp_path / "b", cache_dir=CACHE, chunked_prefill_size=256, dumps=a.dump_dir)
    try:
        b.start_server(["--dump-dtype", DTYPE_FP8])
        [newest] = [m for m in mk.markers(a.dump_dir) if m.info.get("pid") == b.procs[
            "server"].pid]
        assert mk.live(mk.markers(a.dump_dir))[-1] == newest
        # When a worker of A's bf16 run starts and works
        keys = enqueue(a, tmp_path, 4)
        w = a.start_worker("wa", concurrency=2, wait=False)
        wait_until(lambda: not w.alive() or b" ready." in w.log.read_bytes(), 180,
                   "the worker to start or stop")
        # Then it read A's marker, not B's: it starts (no exit 2 citing B's fp8) and works
        log = w.log.read_text()
        assert w.alive(), log[-3000:]
        assert "fp8_e4m3" not in log
        wait_finished(a, len(keys))
        status = json.loads(a.cli("status", "--json").stdout)
        assert status["done"] == 4 and status["admission"]["dp_groups"] == 2
        # And verify of each server checks that server's own marker and groups
        for farm, groups in ((a, 2), (b, 1)):
            res = _verify(a.dump_dir, farm.server_port)
            assert res.returncode == 0, res.stdout + res.stderr
            pid = farm.procs["server"].pid
            assert f"PASS  ready marker: pid {pid} (alive)" in res.stdout, res.stdout
            assert ("2 DP groups, one request pinned to each" in res.stdout) == (groups == 2)
        # And where nothing names the server (an older hook's dump), the dtype check refuses
        # the shared dir, naming both servers
        from worker.core import dumps

        why = dumps.served_dtype_problem(a.dump_dir, DTYPE_BF16) or ""
        assert "2 servers write into this dump dir" in why, why
        for farm in (a, b):
            assert f"pid {farm.procs['server'].pid}," in why, why
        assert dumps.served_dtype_problem(a.dump_dir, DTYPE_BF16, newest.writer) \
            and dumps.served_dtype_problem(a.dump_dir, DTYPE_FP8, newest.writer) is None
    finally:
        b.close(kill=True)
