"""The reconciler: a sample whose task message was lost is published again by the run itself,
and nothing that runs, is queued or is about to be acknowledged ever is."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from celery import Celery

from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from producer.localfarm.farm import LocalFarm
from tests.conftest import CACHE
from worker.app import celery_config
from worker.core.run import task_id
from worker.core.store import OutputStore
from worker.state import keys, ledger
from worker.state import lease as leases
from worker.state.index import Registered, RunIndex
from worker.steps.reconciler import Reconciler

HEAL_ENV = {"FARM_RECONCILE_INTERVAL_S": "2", "FARM_RECONCILE_CONFIRM_S": "2"}


def _fingerprint() -> Fingerprint:
    return Fingerprint(config_sha256="a", tokenizer_sha256="b", chat_template_sha256="c",
                       layers_to_capture=(2, 4, 5), layer_convention=LAYER_CONVENTION,
                       hidden_size=4, dtype="bfloat16", max_tokens=8192, overlong="reject")


def _message(run_id: str, key: str) -> bytes:
    """A task message as kombu keeps it, as far as the reconciler reads it."""
    return orjson.dumps({"headers": {"id": task_id(run_id, 1, key)}, "body": ""})


@pytest.mark.timeout(60)
def test_nothing_queued_running_or_about_to_be_acked_is_republished(
        tmp_path: Path, redis_url: str) -> None:
    # Given a run on a real Redis whose samples are in every state at once
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, redis_url=redis_url,
                     extra_env=HEAL_ENV)
    try:
        settings = farm.settings()
        store = OutputStore(settings.output_dir, _fingerprint()).open()
        app = Celery("reconciler-test")
        app.conf.update(celery_config(settings))
        r, run = farm.redis(), store.run_id
        index = RunIndex(r, run)
        fid = index.register_file(str(tmp_path / "data.json"))
        names = ["queued", "unacked", "running", "acking", "delivering", "starting", "lost"]
        index.register({k: Registered(fid, i * 10, 10, "0" * 64, i) for i, k in enumerate(names)})
        queue = farm.queue()
        r.lpush(queue, _message(run, "queued"))
        unacked = orjson.dumps([orjson.loads(_message(run, "unacked")), "", queue])
        r.hset(keys.KOMBU_UNACKED, "tag-1", unacked)
        r.set(leases.lease_name(run, "running"), "someone#1", px=30_000)  # an attempt runs
        index.mark_done("acking", 100, 10)  # verified and marked done; its ack is on the way
        rec, rival = Reconciler(app, settings, store), Reconciler(app, settings, store)
        seen_rival: list[object] = []

        def meanwhile(_: float) -> bool:
            # between the two reads: a delivery's consumer writes its unacked entry, an attempt
            # takes its lease, and a second reconciler tries a pass of its own
            delivered = orjson.dumps([orjson.loads(_message(run, "delivering")), "", queue])
            r.hset(keys.KOMBU_UNACKED, "tag-2", delivered)
            r.set(leases.lease_name(run, "starting"), "someone#2", px=30_000)
            seen_rival.append(rival.run_pass(sleep=lambda _: False))
            return False

        # When one reconciler pass runs
        result = rec.run_pass(sleep=meanwhile)
        # Then only the sample in no state both times is published again, once; the second
        # reconciler did nothing while the first held the lease
        assert result is not None and result.suspects == 3 and result.republished == 1
        assert seen_rival == [None]
        assert index.republished() == {"lost": 1}
        queued = [json.loads(m)["headers"]["id"] for m in r.lrange(queue, 0, -1)]
        assert sorted(q.rsplit(":", 1)[1] for q in queued) == ["lost", "queued"]
        # and a second pass finds nothing left to heal
        again = rec.run_pass(sleep=lambda _: False)
        assert again is not None and again.suspects == 0
        assert r.hget(index.k(keys.REPUBLISHED), "lost") == b"1"
    finally:
        farm.close(kill=True)


@pytest.mark.timeout(60)
def test_the_output_dir_tells_which_enqueues_redis_lost(
        tmp_path: Path, redis_url: str) -> None:
    # Given two complete enqueues recorded in Redis and in the output dir
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, redis_url=redis_url)
    try:
        r, out = farm.redis(), tmp_path / "out"
        out.mkdir()
        ledger.record(r, "run1", out, "/data/a.json")
        ledger.record(r, "run1", out, "/data/b.json")
        assert ledger.not_in_redis(r, "run1", out) == []
        # When Redis loses the last write of b's enqueue (an earlier token is what it kept),
        # and later everything
        r.hset(keys.run_key("run1", keys.ENQUEUED), "/data/b.json", "an-older-token")
        assert [e.path for e in ledger.not_in_redis(r, "run1", out)] == ["/data/b.json"]
        r.flushall()
        # Then the output dir names every file whose record must be restored
        assert sorted(e.path for e in ledger.not_in_redis(r, "run1", out)) == [
            "/data/a.json", "/data/b.json"]
        assert ledger.not_in_redis(r, "run1", tmp_path) == []  # no record: nothing to restore
        # And an enqueue with a limit is recorded with the widest limit of the file's
        # enqueues; a whole enqueue records none
        ledger.record(r, "run1", out, "/data/c.json", 30)
        ledger.record(r, "run1", out, "/data/c.json", 10)
        assert {e.path: e.limit for e in ledger.read(out)}["/data/c.json"] == 30
        ledger.record(r, "run1", out, "/data/c.json")
        ledger.record(r, "run1", out, "/data/c.json", 5)
        assert {e.path: e.limit for e in ledger.read(out)} == dict.fromkeys(
            ["/data/a.json", "/data/b.json", "/data/c.json"])
    finally:
        farm.close(kill=True)
