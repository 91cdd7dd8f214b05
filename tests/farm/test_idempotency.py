"""Running enqueue again, while queued and after done, publishes and extracts nothing twice."""

from __future__ import annotations

from pathlib import Path

from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import CACHE, FAST_ENV, assert_farm_invariants, wait_finished, write_samples
from tests.support.faults import attempts as _attempts


def test_enqueue_twice_and_after_done(tmp_path: Path, tiny_model: Path) -> None:
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, chunked_prefill_size=128,
                     extra_env=dict(FAST_ENV))
    try:
        farm.start_redis()
        farm.start_server(["--forward-delay-s", "0.02"])
        data = tmp_path / "data.json"
        samples = write_samples(data, 50)
        keys = [str(s["id"]) for s in samples]
        # Given the samples enqueued before any worker runs
        first = farm.cli("enqueue", str(data), "--no-progress")
        assert "published: 50" in first.stdout, first.stdout + first.stderr
        # When enqueue runs again while they are all still queued
        second = farm.cli("enqueue", str(data), "--no-progress")
        # Then nothing is published again
        assert "published: 0" in second.stdout and "already queued or running: 50" in second.stdout
        farm.start_worker("w1", concurrency=2)
        farm.start_worker("w2", concurrency=2)
        mid = farm.cli("enqueue", str(data), "--no-progress")  # while running
        assert "published: 0" in mid.stdout, mid.stdout
        wait_finished(farm, 50)
        # And after everything is done, a third run finds them on disk
        third = farm.cli("enqueue", str(data), "--no-progress")
        assert "published: 0" in third.stdout and "already done: 50" in third.stdout
        assert_farm_invariants(farm, keys)
        # No sample was extracted twice: one attempt each, one "done" line each
        assert _attempts(farm) == dict.fromkeys(keys, 1)
        logs = farm.procs["w1"].log.read_text() + farm.procs["w2"].log.read_text()
        assert sum(f" {k} a1 done n=" in logs for k in keys) == 50
        assert logs.count(" done n=") == 50
        dry = farm.cli("enqueue", str(data), "--no-progress", "--dry-run")
        assert "published: 0" in dry.stdout
    finally:
        farm.close(kill=True)


def test_duplicate_deliveries_never_run_at_once(tmp_path: Path, tiny_model: Path) -> None:
    # Given every sample's message twice in the queue (as after a restore while the first
    # delivery still runs, or two producers), and a slow server so the two overlap
    import json
    import uuid

    from tests.support.faults import enqueue, running_farm

    with running_farm(tmp_path, ["--forward-delay-s", "0.05"]) as farm:
        keys = enqueue(farm, tmp_path, 16)
        r, queue = farm.redis(), farm.queue()
        originals = r.lrange(queue, 0, -1)[::-1]  # in the order they are consumed
        r.delete(queue)
        for raw in originals:  # each message, then its twin right behind it
            msg = json.loads(raw)
            twin = f"twin-{uuid.uuid4().hex[:8]}"
            msg["headers"]["id"] = msg["properties"]["correlation_id"] = twin
            msg["properties"]["delivery_tag"] = str(uuid.uuid4())
            r.lpush(queue, raw, json.dumps(msg))
        assert r.llen(queue) == 32
        # When two workers take them
        farm.start_worker("w1", concurrency=2)
        farm.start_worker("w2", concurrency=2)
        wait_finished(farm, 16)
        wait_until(lambda: r.llen(queue) == 0 and r.hlen("unacked") == 0, 60, "the twins")
        # Then each sample was extracted once, in one attempt, and nothing failed: the twin
        # waited for the lease, then found the sample done
        assert_farm_invariants(farm, keys)
        assert _attempts(farm) == dict.fromkeys(keys, 1)
        logs = farm.procs["w1"].log.read_text() + farm.procs["w2"].log.read_text()
        assert all(logs.count(f" {k} a1 done n=") == 1 for k in keys)
        assert logs.count("already done (verified from disk)") == 16
        assert "waiting for hsfarm:" in logs  # some twins did arrive while the first ran
