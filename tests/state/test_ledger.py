"""The output dir's ledger of complete enqueues (worker/state/ledger.py) against a real Redis
and a real output dir: what it tells the reconciler Redis lost."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from worker.core import outdir
from worker.state import keys, ledger

RUN = "1" * 16


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_a_complete_enqueue_is_on_disk_and_in_redis_with_one_token(r: redis.Redis,
                                                                   tmp_path: Path) -> None:
    # When a file's enqueue completes
    ledger.record(r, RUN, tmp_path, "/data/a.jsonl")
    # Then the output dir and Redis hold the same token for it, and nothing is missing
    [entry] = ledger.read(tmp_path)
    assert entry.path == "/data/a.jsonl" and entry.limit is None
    assert r.hget(keys.run_key(RUN, keys.ENQUEUED), "/data/a.jsonl") == entry.token.encode()
    assert ledger.not_in_redis(r, RUN, tmp_path) == []


def test_what_redis_lost_or_holds_from_another_enqueue_is_named(r: redis.Redis,
                                                                tmp_path: Path) -> None:
    # Given two files enqueued
    ledger.record(r, RUN, tmp_path, "/data/a.jsonl")
    ledger.record(r, RUN, tmp_path, "/data/b.jsonl")
    # When Redis lost one (a restart that kept a prefix of its AOF) and holds an older token
    # of the other (the enqueue that wrote the disk's token never reached it)
    r.hdel(keys.run_key(RUN, keys.ENQUEUED), "/data/a.jsonl")
    r.hset(keys.run_key(RUN, keys.ENQUEUED), "/data/b.jsonl", "old")
    # Then both are to be enqueued again
    assert sorted(e.path for e in ledger.not_in_redis(r, RUN, tmp_path)) == [
        "/data/a.jsonl", "/data/b.jsonl"]
    # And another run's record says nothing of this one's
    assert ledger.not_in_redis(r, "2" * 16, tmp_path) != []


def test_an_enqueue_with_a_limit_is_restored_with_the_widest_limit(r: redis.Redis,
                                                                  tmp_path: Path) -> None:
    ledger.record(r, RUN, tmp_path, "/data/a.jsonl", limit=50)
    ledger.record(r, RUN, tmp_path, "/data/a.jsonl", limit=20)
    assert [e.limit for e in ledger.read(tmp_path)] == [50]
    ledger.record(r, RUN, tmp_path, "/data/a.jsonl", limit=80)
    assert [e.limit for e in ledger.read(tmp_path)] == [80]
    ledger.record(r, RUN, tmp_path, "/data/a.jsonl")  # the whole file: no limit from now on
    ledger.record(r, RUN, tmp_path, "/data/a.jsonl", limit=10)
    assert [e.limit for e in ledger.read(tmp_path)] == [None]


def test_a_later_enqueue_replaces_the_token(r: redis.Redis, tmp_path: Path) -> None:
    ledger.record(r, RUN, tmp_path, "/data/a.jsonl")
    [first] = ledger.read(tmp_path)
    ledger.record(r, RUN, tmp_path, "/data/a.jsonl")
    [second] = ledger.read(tmp_path)
    assert first.token != second.token
    assert ledger.not_in_redis(r, RUN, tmp_path) == []


@pytest.mark.parametrize("body", ["", "{", "[]", '{"files": 3}', '{"nofiles": {}}'])
def test_an_unreadable_ledger_restores_nothing_and_is_written_anew(
        r: redis.Redis, tmp_path: Path, body: str) -> None:
    # Given a damaged enqueued.json
    (tmp_path / outdir.ENQUEUED_JSON).write_text(body)
    # Then it names nothing to restore, and the next enqueue writes a whole one
    assert ledger.read(tmp_path) == [] and ledger.not_in_redis(r, RUN, tmp_path) == []
    ledger.record(r, RUN, tmp_path, "/data/a.jsonl")
    written = json.loads((tmp_path / outdir.ENQUEUED_JSON).read_text())
    assert list(written["files"]) == ["/data/a.jsonl"] and written["limits"] == {}
