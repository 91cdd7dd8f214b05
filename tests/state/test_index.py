"""The run index on a real Redis: a sample is done only until someone finds its file missing or
damaged; outcomes and running entries that land after done are dropped, those of a redo are not."""

from __future__ import annotations

import pytest
import redis

from worker.state import keys
from worker.state import lease as leases
from worker.state.index import RunIndex

RUN = "run-a"


def _index(redis_url: str) -> RunIndex:
    return RunIndex(redis.Redis.from_url(redis_url), RUN)


@pytest.mark.timeout(20)
def test_an_outcome_or_running_entry_landing_after_done_is_dropped(redis_url: str) -> None:
    # Given a sample marked done by one attempt
    index = _index(redis_url)
    index.mark_done("s1", 100, 10, "host-a", "sha")
    # When another attempt's outcomes and running entry land late (Redis was away)
    index.mark_retrying("s1", 1, "Transient: timed out")
    index.mark_failed("s1", "gave up", 5)
    late = index.mark_running("s1", "host-b:123", 2)
    # Then none is recorded: the sample stays done, not running
    assert not late
    assert index.done_keys() == {"s1"}
    for name in (keys.FAILED, keys.RETRYING, keys.RUNNING):
        assert index.outcomes(name) == {}, name
    c = index.counts()
    assert (c.done, c.failed, c.retrying, c.running) == (1, 0, 0, 0)


@pytest.mark.timeout(20)
def test_a_requeue_takes_a_sample_out_of_done_and_its_redo_outcomes_count(
        redis_url: str) -> None:
    # Given a done sample, held by a host, whose file was then found damaged
    index = _index(redis_url)
    index.mark_done("s1", 100, 10, "host-a", "sha")
    index.mark_done("s2", 100, 10, "host-a", "sha")
    # When it is requeued
    index.forget_outcome("s1")
    # Then it is not done and held by no host; the other sample is untouched
    assert index.done_keys() == {"s2"}
    assert index.r.hget(index.k(keys.HELD), "s1") is None
    assert index.counts().bytes == 100
    # And its redo's running entry, retries and failure are recorded
    assert index.mark_running("s1", "host-a:1", 1)
    index.mark_retrying("s1", 1, "Corrupt: NaN")
    assert set(index.outcomes(keys.RETRYING)) == {"s1"}
    index.mark_failed("s1", "Corrupt: NaN", 5)
    c = index.counts()
    assert (c.done, c.failed, c.retrying, c.running) == (1, 1, 0, 0)


@pytest.mark.timeout(20)
def test_unmark_done_lets_the_attempt_that_found_the_file_damaged_record_its_outcome(
        redis_url: str) -> None:
    # Given a done sample whose file a worker's attempt found damaged
    index = _index(redis_url)
    index.mark_done("s1", 100, 10, "host-a", "sha")
    # When the attempt takes it out of done, then runs and fails for good
    index.unmark_done(["s1"])
    assert index.mark_running("s1", "host-a:1", 1)
    index.mark_failed("s1", "gave up", 5)
    # Then the failure is recorded and nothing says done
    assert index.done_keys() == set()
    assert set(index.outcomes(keys.FAILED)) == {"s1"}
    assert index.done_sizes(["s1"]) == [None]
    assert index.r.hget(index.k(keys.HELD), "s1") is None


@pytest.mark.timeout(20)
def test_in_question_names_samples_whose_header_is_not_enough(redis_url: str) -> None:
    # Given samples that failed, are retrying, are held by an attempt, and one never tried
    index = _index(redis_url)
    index.mark_failed("failed", "gave up", 5)
    index.mark_retrying("retrying", 1, "Corrupt")
    index.r.set(leases.lease_name(RUN, "leased"), "someone#1", px=30_000)
    # When asked which need more than a header to count as done
    got = index.in_question(["failed", "retrying", "leased", "fresh"])
    # Then all but the untried one
    assert got == [True, True, True, False]
    assert index.in_question([]) == []


@pytest.mark.timeout(20)
def test_the_done_history_reads_by_time_with_each_file_s_size(redis_url: str) -> None:
    # Given three samples done at known times (a relearnt batch keeps its files' mtimes)
    index = _index(redis_url)
    assert (index.done_at_edge(newest=False), index.done_count()) == (None, 0)
    index.mark_done_many({"a": (10, 1), "b": (20, 2), "c": (30, 3)},
                         at={"a": 100.0, "b": 200.0, "c": 300.0})
    # Then the history reads by time, both ways, bounded, with the sizes verified
    assert index.done_between(150) == [("b", 200.0), ("c", 300.0)]
    assert index.done_between(0, 300, limit=2, newest_first=True) == [("c", 300.0),
                                                                      ("b", 200.0)]
    assert (index.done_count(), index.done_count(100, 200)) == (3, 2)
    assert (index.done_at_edge(newest=False), index.done_at_edge(newest=True)) == (100.0, 300.0)
    assert index.file_sizes(["c", "a", "nope"]) == [30, 10, None]
    assert index.file_sizes([]) == []


@pytest.mark.timeout(20)
def test_a_refund_takes_back_only_the_attempt_still_remembered(redis_url: str) -> None:
    # Given an attempt running, its entry remembered (as the outage watch does)
    index = _index(redis_url)
    index.next_attempt("s1")
    index.mark_running("s1", "host-a:1", 1)
    [body] = index.running_bodies(["s1"])
    assert body is not None and index.running_bodies(["none"]) == [None]
    # When a newer attempt rewrote the entry, Then nothing is refunded
    index.next_attempt("s1")
    index.mark_running("s1", "host-a:2", 2)
    assert not index.refund_running("s1", body)
    assert int(index.r.hget(index.k(keys.ATTEMPTS), "s1") or 0) == 2
    # And the entry as remembered is refunded once: the attempt and the entry go
    [newer] = index.running_bodies(["s1"])
    assert newer is not None and index.refund_running("s1", newer)
    assert not index.refund_running("s1", newer)
    assert int(index.r.hget(index.k(keys.ATTEMPTS), "s1") or 0) == 1
    assert index.outcomes(keys.RUNNING) == {}


@pytest.mark.timeout(20)
def test_settled_keys_leases_and_republished_counts(redis_url: str) -> None:
    # Given a failed, a rejected and a leased sample, and one republished twice
    index = _index(redis_url)
    index.mark_failed("f", "gave up", 5)
    index.mark_rejected("r", "bad input", sha="sha")
    lease = leases.try_acquire(index.r, leases.lease_name(RUN, "l"), 30)
    assert isinstance(lease, leases.Lease)
    index.note_republished("x")
    index.note_republished("x")
    # Then each reads back from its own hash
    assert index.settled_keys([keys.FAILED, keys.REJECTED]) == {"f", "r"}
    assert index.settled_keys([keys.STALE]) == set()
    assert index.leased(["l", "f"]) == [True, False] and index.leased([]) == []
    assert index.republished() == {"x": 2}
    lease.release()
    assert index.leased(["l"]) == [False]
