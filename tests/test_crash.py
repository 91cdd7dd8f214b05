"""Crashes with real SIGKILLs: a worker's pool process, and a worker's main process."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from producer.localfarm import LocalFarm, wait_until
from tests.conftest import (
    CACHE,
    FAST_ENV,
    assert_farm_invariants,
    wait_finished,
    write_samples,
)
from worker import keys


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _running_pids(farm: LocalFarm) -> dict[int, str]:
    """pid → sample key for the tasks running right now (from the run index)."""
    r = farm.redis()
    out = {}
    for k in r.scan_iter(f"{keys.PREFIX}:*:{keys.RUNNING}"):
        for key, body in r.hgetall(k).items():
            pid = int(json.loads(body)["worker"].rsplit(":", 1)[1])
            out[pid] = _text(key)
    return out


def _attempts(farm: LocalFarm) -> dict[str, int]:
    r = farm.redis()
    out: dict[str, int] = {}
    for k in r.scan_iter(f"{keys.PREFIX}:*:{keys.ATTEMPTS}"):
        out.update({_text(key): int(v) for key, v in r.hgetall(k).items()})
    return out


def _start(farm: LocalFarm, tmp_path: Path, n: int) -> list[str]:
    data = tmp_path / "data.json"
    samples = write_samples(data, n)
    res = farm.cli("enqueue", str(data), "--no-progress")
    assert res.returncode == 0, res.stderr
    return [str(s["id"]) for s in samples]


def _kill_busy_child(farm: LocalFarm, worker: str) -> str:
    """SIGKILL a pool process of ``worker`` while it is in the middle of a task."""
    busy: dict[int, str] = {}

    def found() -> bool:
        nonlocal busy
        children = set(farm.procs[worker].children())
        busy = {p: k for p, k in _running_pids(farm).items() if p in children}
        return bool(busy)

    wait_until(found, 60, f"a busy pool process in {worker}", poll_s=0.02)
    pid, key = next(iter(busy.items()))
    os.kill(pid, signal.SIGKILL)
    return key


def test_sigkill_pool_process_mid_task(tmp_path: Path, tiny_model: Path) -> None:
    # Given a slow-ish server (so tasks are caught mid-request) and two workers
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, chunked_prefill_size=64,
                     extra_env=dict(FAST_ENV))
    try:
        farm.start_redis()
        farm.start_server(["--forward-delay-s", "0.05"])
        farm.start_worker("w1", concurrency=2)
        farm.start_worker("w2", concurrency=2)
        keys_expected = _start(farm, tmp_path, 40)
        # When pool processes are SIGKILLed in the middle of tasks, three times
        killed = [_kill_busy_child(farm, w) for w in ("w1", "w2", "w1")]
        wait_finished(farm, 40)
        # Then every sample, the killed ones too, has exactly one verified file
        assert_farm_invariants(farm, keys_expected)
        attempts = _attempts(farm)
        assert all(attempts[k] >= 2 for k in killed), (killed, attempts)
        assert "WorkerLostError" in farm.procs["w1"].log.read_text()
    finally:
        farm.close()


def test_sigkill_worker_main_process(tmp_path: Path, tiny_model: Path) -> None:
    # Given two workers, one of which will lose its main process
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, chunked_prefill_size=64,
                     extra_env=dict(FAST_ENV))
    try:
        farm.start_redis()
        farm.start_server(["--forward-delay-s", "0.05"])
        farm.start_worker("w1", concurrency=2)
        farm.start_worker("w2", concurrency=2)
        keys_expected = _start(farm, tmp_path, 40)
        # When w2's main process is SIGKILLed while its pool is busy
        busy: list[int] = []

        def w2_busy() -> bool:
            children = set(farm.procs["w2"].children())
            busy[:] = [p for p in _running_pids(farm) if p in children]
            return bool(busy)

        wait_until(w2_busy, 60, "w2 busy", poll_s=0.02)
        farm.procs["w2"].kill(signal.SIGKILL)
        # its pool processes do not outlive it
        wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in busy), 30,
                   "w2's pool processes to exit")
        # Then w1 finishes the queue, and w2's unacknowledged tasks come back after the
        # visibility timeout (seconds here; FARM_VISIBILITY_TIMEOUT_S), not the 1-hour default
        farm.start_worker("w2b", concurrency=2)
        wait_finished(farm, 40, timeout_s=180)
        assert_farm_invariants(farm, keys_expected)
        logs = farm.procs["w1"].log.read_text() + farm.procs["w2b"].log.read_text()
        assert "redelivered" in logs or max(_attempts(farm).values()) >= 2
    finally:
        farm.close()
