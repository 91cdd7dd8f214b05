"""The reconciler: a sample whose task message was lost is published again by the run itself,
and nothing that runs, is queued or is about to be acknowledged ever is."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from producer.localfarm.farm import wait_until
from tests.conftest import assert_farm_invariants, wait_finished, write_samples
from tests.support.faults import attempts, busy_child, dashboard_metrics, enqueue, running_farm
from worker.state import keys
from worker.state.index import RunIndex

N_KILL = 20  # samples of the Redis-kill runs
REDIS_AWAY_S = 8  # how long the test's Redis is unreachable (AOF always)
HEAL_ENV = {"FARM_RECONCILE_INTERVAL_S": "2", "FARM_RECONCILE_CONFIRM_S": "2"}


@pytest.mark.timeout(240)
def test_lost_messages_are_published_again_by_the_run(tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path, env=HEAL_ENV) as farm:
        # Given 30 samples enqueued, and 3 of their messages removed from the queue by hand
        sample_keys = enqueue(farm, tmp_path, 30)
        r, queue = farm.redis(), farm.queue()
        removed = []
        for raw in r.lrange(queue, 0, 2):
            removed.append(json.loads(raw)["headers"]["id"].rsplit(":", 1)[1])
            assert r.lrem(queue, 1, raw) == 1  # type: ignore[arg-type]
        lost_at = time.monotonic()
        # When workers run, and nobody runs a command
        farm.start_worker("w1", concurrency=2)
        # Then the 3 are found in no state, published again once each, and done: all 30
        # done exactly once, within the reconciler's bound
        wait_until(lambda: all(r.zscore(f"{keys.PREFIX}:{farm.run_id()}:{keys.DONE}", k)
                               for k in removed), 120, "the lost samples to be done", poll_s=0.2)
        healed_s = time.monotonic() - lost_at
        wait_finished(farm, 30, timeout_s=120)
        assert_farm_invariants(farm, sample_keys)
        index = RunIndex(r, farm.run_id())
        assert index.republished() == dict.fromkeys(removed, 1)
        logs = "".join(farm.procs[w].log.read_text() for w in ("w1",))
        assert sorted(re.findall(r" (\S+) republished: ", logs)) == sorted(removed)
        done_lines = re.findall(r" (\S+) a\d+ done n=", logs)
        assert sorted(done_lines) == sorted(sample_keys), "a sample done twice, or not at all"
        status = farm.cli("status")
        assert "healed    3 lost task message(s)" in status.stdout, status.stdout
        # (the dashboard and /metrics count them too)
        snapshot, metrics = dashboard_metrics(farm.settings())
        assert snapshot["status"]["republished"] == 3, snapshot["status"]
        assert re.search(r'^hsfarm_republished_total\{run="\w+"\} 3$', metrics, re.M), metrics
        ready = _log_time(logs, r" w1@\S+ ready\.")
        again = max(_log_time(logs, rf" {k} republished: ") for k in removed)
        done = max(_log_time(logs, rf" {k} a\d+ done n=") for k in removed)
        print(f"HEAL lost-to-done {healed_s:.1f}s; from the worker ready: republished after "
              f"{again - ready:.1f}s, done after {done - ready:.1f}s (interval 2 s, confirm 2 s)")
        assert healed_s < 60


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fsync", ["always", "everysec"])
def test_redis_killed_mid_run_loses_nothing(tmp_path: Path, tiny_model: Path, fsync: str) -> None:
    # Given a Redis with AOF appendfsync ``fsync`` and a run in full swing (``always``: Redis
    # then stays unreachable for a while: the workers pause, spending no attempt, and resume)
    redis_args = ["--appendfsync", fsync]
    env = {**HEAL_ENV, "FARM_LEASE_TTL_S": "8"}  # leases the rewind brings back expire soon
    # (``always``: each sample is one forward of 1.5 s, so attempts are surely in flight, and
    # seen by the workers' outage watch, when Redis goes away)
    slow = fsync == "always"
    with running_farm(tmp_path, ["--forward-delay-s", "1.5"] if slow else None, env=env,
                      chunk=4096 if slow else 256, start_redis=False) as farm:
        farm.start_redis(extra_args=redis_args)
        farm.start_worker("w1", concurrency=2)
        aof = farm.work_dir / "redis" / "appendonlydir"
        if fsync == "everysec":
            # what a crash of the machine under everysec may keep: the AOF as it was before
            # the writes of the last moments, here all of the enqueue's (its samples, its
            # messages); a SIGKILL of redis-server alone loses nothing, its writes are in the
            # kernel already
            wait_until(lambda: any(aof.glob("*.incr.aof")), 10, "the AOF")
            shutil.copytree(aof, tmp_path / "aof-before")
        sample_keys = enqueue(farm, tmp_path, N_KILL)
        busy_child(farm, "w1")
        time.sleep(1.2)
        # When redis-server is SIGKILLed mid-run and started again, and nobody runs a command
        farm.procs["redis"].kill(signal.SIGKILL)
        if fsync == "everysec":
            shutil.rmtree(aof)
            shutil.copytree(tmp_path / "aof-before", aof)
        time.sleep(1 if fsync == "everysec" else REDIS_AWAY_S)  # unreachable meanwhile
        farm.start_redis(extra_args=redis_args)
        # Then the run finishes: every sample done once, nothing lost or doubled
        wait_finished(farm, N_KILL, timeout_s=180)
        assert_farm_invariants(farm, sample_keys)
        logs = farm.procs["w1"].log.read_text()
        done_lines = re.findall(r" (\S+) a\d+ done n=", logs)
        duplicated = len(done_lines) - len(set(done_lines))
        index = RunIndex(farm.redis(), farm.run_id())
        assert len(index.done_keys()) == N_KILL
        figures = {"fsync": fsync, "samples": N_KILL, "done": len(index.done_keys()),
                   "extracted": len(done_lines),
                   "redeliveries": len(re.findall(r" already done \(verified", logs))
                   + sum(a - 1 for a in attempts(farm).values()),
                   "republished": sum(index.republished().values()),
                   "re_enqueued": logs.count("re-enqueued "),
                   "duplicated": duplicated, "lost": N_KILL - len(index.done_keys())}
        print("REDIS-KILL", json.dumps(figures))
        assert duplicated == 0, figures
        if fsync == "everysec":
            assert figures["re_enqueued"] == 1, figures
        else:  # the attempts Redis's absence cancelled were refunded: each sample spent one
            # attempt plus its counted failures (a loaded machine may time some out), or none
            # when the refunded attempt had made its file before Redis went and its redelivery
            # found it whole
            assert "attempt refunded: cancelled when Redis went away" in logs
            failures = Counter(re.findall(r" (\S+) a\d+ failed", logs))
            found = set(re.findall(r" (\S+) already done \(verified from disk\)", logs))
            spent = {k: a - failures[k] for k, a in attempts(farm).items()}
            assert all(n == 1 or (n == 0 and k in found) for k, n in spent.items()), \
                (spent, failures, found)


@pytest.mark.timeout(300)
def test_an_enqueue_with_a_limit_is_restored_with_it_after_redis_lost_everything(
        tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path, env=HEAL_ENV) as farm:
        # Given the first 30 records of a data file of 100 enqueued (``--limit 30``)
        data = tmp_path / "data.json"
        first = [str(s["id"]) for s in write_samples(data, 100)][:30]
        res = farm.cli("enqueue", str(data), "--no-progress", "--limit", "30")
        assert res.returncode == 0 and "published: 30" in res.stdout, res.stdout + res.stderr
        index = RunIndex(farm.redis(), farm.run_id())
        # When Redis loses everything, and a worker runs
        farm.redis().flushall()
        farm.start_worker("w1", concurrency=2)
        # Then the reconciler enqueues the file again with its limit: the run holds the 30
        wait_until(lambda: index.r.hlen(index.k(keys.SAMPLES)) >= 30, 60,
                   "the run's record of the 30 samples restored", poll_s=0.2)
        wait_finished(farm, 30, timeout_s=180)
        assert sorted(index.all_registered()) == sorted(first)
        assert sorted(index.done_keys()) == sorted(first)
        logs = farm.procs["w1"].log.read_text()
        assert f"record of {data} (its first 30 records): enqueueing it again" in logs, logs
        # And status says the run is finished: 30 done of 30, nothing remaining
        status = farm.cli("status", "--check")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "progress  30/30 done (100.0%), failed 0, rejected 0, remaining 0" in \
            status.stdout, status.stdout
        assert "finished: every sample has an outcome (30 done" in status.stdout, status.stdout


@pytest.mark.timeout(400)


def _log_time(logs: str, pattern: str) -> float:
    """The time of the first log line matching ``pattern`` (seconds since the epoch)."""
    m = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*" + pattern, logs, re.M)
    assert m, pattern
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
