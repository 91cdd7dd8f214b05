"""Crashes with real SIGKILLs: a worker's pool process (mid-request and mid-copy), and a
worker's main process."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from engine_dump.dumpfile import TMP_MARK, is_temp_name
from producer.localfarm.farm import wait_until
from tests.conftest import assert_farm_invariants, wait_finished
from tests.support.faults import (
    attempts,
    busy_child,
    enqueue,
    kill,
    run_hash,
    running_farm,
    running_pids,
)
from worker.state import keys as keys_mod


def test_sigkill_pool_process_mid_request(tmp_path: Path, tiny_model: Path) -> None:
    # Given a slow-ish server, so tasks are caught mid-request, and two workers
    with running_farm(tmp_path, ["--forward-delay-s", "0.05"]) as farm:
        farm.start_worker("w1", concurrency=2)
        farm.start_worker("w2", concurrency=2)
        keys = enqueue(farm, tmp_path, 24)
        # When pool processes are SIGKILLed in the middle of tasks, three times
        killed = []
        for w in ("w1", "w2", "w1"):
            pid, key = busy_child(farm, w)
            kill(pid)
            killed.append(key)
        wait_finished(farm, 24)
        # Then every sample, the killed ones too, has exactly one verified file
        assert_farm_invariants(farm, keys)
        # And each killed sample was extracted again, or (the kill landed after its file was
        # written, before the acknowledgement) its redelivery found the file whole
        logs = "".join(farm.procs[w].log.read_text() for w in ("w1", "w2"))
        for k in killed:
            assert attempts(farm)[k] >= 2 or f" {k} already done (verified from disk)" in logs, \
                (k, attempts(farm))
        assert "WorkerLostError" in farm.procs["w1"].log.read_text()


def test_sigkill_pool_process_mid_copy(tmp_path: Path, tiny_model: Path) -> None:
    # Given workers that pause between writing a final file's temp file and renaming it
    with running_farm(tmp_path, env={"FARM_DEBUG_WRITE_DELAY_S": "0.5"}) as farm:
        farm.start_worker("w1", concurrency=2)
        keys = enqueue(farm, tmp_path, 12)
        samples = farm.output_dir / "samples"
        # When the writer of a half-written temp file is SIGKILLed, twice
        temps: list[Path] = []

        def temp_exists() -> bool:
            temps[:] = [p for p in samples.rglob("*") if is_temp_name(p.name)]
            return bool(temps)

        for _ in range(2):
            wait_until(temp_exists, 60, "a temp file being written", poll_s=0.01)
            pid = int(temps[0].name.split(TMP_MARK, 1)[1].rsplit(".", 2)[1])
            kill(pid)
        wait_finished(farm, 12)
        # Then no partial or temp file is left and every sample verifies
        assert_farm_invariants(farm, keys)


def test_sigkill_worker_main_process(tmp_path: Path, tiny_model: Path) -> None:
    # Given the default visibility timeout (20 minutes), which alone would hold a dead
    # worker's messages that long
    env = {"FARM_VISIBILITY_TIMEOUT_S": "1200"}
    with running_farm(tmp_path, ["--forward-delay-s", "0.05"], env=env) as farm:
        farm.start_worker("w1", concurrency=2)
        farm.start_worker("w2", concurrency=2)
        keys = enqueue(farm, tmp_path, 24)
        # When w2's main process is SIGKILLed while its pool is busy
        pid, key = busy_child(farm, "w2")
        t_kill = time.monotonic()
        farm.procs["w2"].kill(signal.SIGKILL)
        # its pool processes do not outlive it
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), 30, "w2's pool to exit")
        # Then w1 returns w2's unacknowledged messages to the queue within seconds, and its
        # sample runs again (or is done) within 30 s, nowhere near the visibility timeout
        def again() -> bool:
            return (key in run_hash(farm, keys_mod.BYTES)
                    or any(p != pid for p, k in running_pids(farm).items() if k == key))

        wait_until(again, 60, f"{key} to run again", poll_s=0.2)
        recovery_s = time.monotonic() - t_kill
        assert recovery_s < 30, f"ran again {recovery_s:.0f}s after the kill"
        # (its pool process may have finished that sample before it exited: w2's other
        # messages come back all the same, when w2's heartbeat has lapsed)
        wait_until(lambda: "of gone worker" in farm.procs["w1"].log.read_text(),
                   max(1.0, t_kill + 30 - time.monotonic()), "w1 to return w2's messages")
        wait_finished(farm, 24, timeout_s=180)
        assert_farm_invariants(farm, keys)
        assert (attempts(farm)[key] >= 2
                or f" {key} already done (verified from disk)" in farm.procs["w1"].log.read_text())
