"""A worker that cannot work takes nothing: it stops before consuming, or waits holding
nothing until it can."""

from __future__ import annotations

import time
from pathlib import Path

from producer.localfarm.farm import free_port, wait_until
from tests.conftest import assert_farm_invariants, wait_finished
from tests.support.faults import enqueue, failed, running_farm
from worker.state.queue_scan import broker_depth


def test_misconfigured_worker_stops_before_taking_anything(tmp_path: Path,
                                                           tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        # Given a run under way (its output dir has its manifest) with samples queued
        farm.start_worker("w1", concurrency=1)
        keys = enqueue(farm, tmp_path, 3)
        wait_finished(farm, 3)
        farm.procs["w1"].stop()
        more = enqueue(farm, tmp_path, 12, start=3)
        queue = farm.queue()
        assert broker_depth(farm.redis(), queue) == (12, 0)
        # When a worker starts with a setting that changes the run (another fingerprint)
        farm.extra_env["FARM_MAX_TOKENS"] = "4096"
        bad = farm.start_worker("bad", concurrency=2, wait=False)
        wait_until(lambda: not bad.alive(), 120, "the misconfigured worker to exit")
        # Then it exits with code 2 and the fix, and the queue still holds every sample
        assert bad.popen is not None and bad.popen.returncode == 2
        log = bad.log.read_text()
        assert "holds hidden states of another run" in log and "max_tokens" in log
        assert " ready." not in log
        assert broker_depth(farm.redis(), queue) == (12, 0)
        # And a worker with the right settings finishes the run
        del farm.extra_env["FARM_MAX_TOKENS"]
        farm.start_worker("w2", concurrency=2)
        wait_finished(farm, 15)
        assert_farm_invariants(farm, keys + more)


def test_worker_started_before_the_server_waits_for_it(tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        # Given samples queued and then the server stopped (still loading, say); the worker
        # must ask the server which model it serves (FARM_MODEL_PATH is not set)
        keys = enqueue(farm, tmp_path, 20)
        farm.procs["server"].stop()
        # When a worker starts
        w = farm.start_worker("w1", concurrency=2, wait=False)
        time.sleep(8)
        # Then it waits, taking nothing, and says what it waits for
        assert w.alive() and " ready." not in w.log.read_text()
        assert "waiting" in w.log.read_text() and "for the server" in w.log.read_text()
        assert broker_depth(farm.redis(), farm.queue()) == (20, 0)
        # And once the server is up, it runs every sample, and none fails
        farm.start_server()
        wait_finished(farm, 20)
        assert not failed(farm)
        assert_farm_invariants(farm, keys)


def test_worker_whose_dump_dir_the_hook_does_not_write_takes_nothing(tmp_path: Path,
                                                                     tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        # Given samples queued, and a worker looking for dumps where the server writes none
        # (FARM_DUMP_DIR is not the server's SGLANG_HS_DUMP_DIR)
        enqueue(farm, tmp_path, 5)
        farm.extra_env["FARM_DUMP_DIR"] = str(tmp_path / "elsewhere")
        w = farm.start_worker("w1", concurrency=2, wait=False)
        # Then its start-up probe fails, it says why, and it takes nothing
        wait_until(lambda: "taking no work" in w.log.read_text(), 120, "the probe to fail")
        assert "no dump of it appeared" in w.log.read_text()
        time.sleep(2)
        assert w.alive() and " ready." not in w.log.read_text()
        assert broker_depth(farm.redis(), farm.queue()) == (5, 0)


def test_a_first_start_on_a_server_capturing_other_layers_records_no_canary(
        tmp_path: Path, tiny_model: Path) -> None:
    from worker.core import canary

    # Given a new run (no canary yet) whose server captures other layers than the run's
    # (the tiny model's run takes [2, 4, 5]), and samples queued
    with running_farm(tmp_path, server_args=["--layers-to-capture", "1", "2", "3"]) as farm:
        keys = enqueue(farm, tmp_path, 20)
        # When the run's first worker starts
        w = farm.start_worker("w1", concurrency=2, wait=False)
        wait_until(lambda: not w.alive(), 120, "the worker to exit")
        # Then it exits 2 with the fix, before recording a canary or taking a sample
        log = w.log.read_text()
        assert w.popen is not None and w.popen.returncode == 2, log[-3000:]
        assert "server captures layers [1, 2, 3], this run expects [2, 4, 5]" in log
        assert "--layers-to-capture 2 4 5" in log
        assert not canary.path_in(farm.output_dir).exists()
        assert broker_depth(farm.redis(), farm.queue()) == (20, 0)
        assert not failed(farm)
        # And once the server captures the run's layers, the run finishes: 20/20
        farm.procs["server"].stop()
        farm.start_server()
        farm.start_worker("w2", concurrency=2)
        wait_finished(farm, 20)
        assert not failed(farm)
        assert canary.path_in(farm.output_dir).exists()
        assert_farm_invariants(farm, keys)


def test_a_worker_that_never_reaches_redis_exits_2_with_the_fix(tmp_path: Path,
                                                                tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        # Given samples queued in the run's Redis
        keys = enqueue(farm, tmp_path, 4)
        good_url = farm.redis_url or f"redis://127.0.0.1:{farm.redis_port}/0"
        # When a worker starts with a mistyped REDIS_URL (a port where nothing listens) and a
        # bounded start-up wait
        farm.extra_env.update(REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
                              FARM_REDIS_START_WAIT_S="3")
        lost = farm.start_worker("lost", concurrency=1, wait=False)
        wait_until(lambda: not lost.alive(), 90, "the worker without Redis to exit")
        # Then it exits 2 (systemd does not restart it) naming the URL and the fix
        assert lost.popen is not None and lost.popen.returncode == 2
        log = lost.log.read_text()
        assert "did not answer within 3 s" in log and "check REDIS_URL" in log, log[-2000:]
        assert "FARM_REDIS_START_WAIT_S" in log and " ready." not in log
        # When a worker's REDIS_URL names a user Redis refuses
        farm.extra_env["REDIS_URL"] = good_url.replace("redis://", "redis://nobody:wrong@")
        refused = farm.start_worker("refused", concurrency=1, wait=False)
        wait_until(lambda: not refused.alive(), 60, "the refused worker to exit")
        # Then it exits 2 at once, saying the credentials are refused
        assert refused.popen is not None and refused.popen.returncode == 2
        assert "refuses this worker's credentials" in refused.log.read_text()
        # And nothing was taken: a worker with the right URL finishes every sample
        farm.extra_env.pop("REDIS_URL")
        assert broker_depth(farm.redis(), farm.queue()) == (4, 0)
        farm.start_worker("w1", concurrency=1)
        wait_finished(farm, 4)
        assert_farm_invariants(farm, keys)
