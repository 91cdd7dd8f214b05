"""Which tasks are in the broker right now: waiting in the queue, or reserved/running.

The ground truth for "already queued or running" (no marker that could go stale): the queue
list plus kombu's ``unacked`` hash, where a delivered message sits until its ack. Task ids are
``hsd-<run id>-<publication>:<sample key>``: one publication per ``enqueue``/``requeue`` makes
each a task of its own (redeliveries keep the id), so a monitor keeping states by id (Flower:
a FAILURE outranks later states) shows a re-enqueued sample's new attempt, not its old outcome.
Test: tests/unit/test_queue_scan.py::test_task_ids_name_their_sample_and_publication."""

from __future__ import annotations

import time

from worker.core.run import QUEUE_PREFIX, message_task_id, sample_key_of, task_id
from worker.state import keys
from worker.state.broker import Client, redis_errors
from worker.state.index import RunIndex

__all__ = ["broker_depth", "broker_sample_keys", "broker_sample_keys_at_once", "broker_task_ids",
           "delivered_at", "is_unacked", "sample_key_of", "task_id", "unacked_older_than"]

_PAGE = 2000


@redis_errors
def broker_task_ids(r: Client, queue: str) -> set[str]:
    """Task ids queued on ``queue`` or unacknowledged anywhere (~34 MB read for 37k tasks)."""
    ids: set[str] = set()
    # to the end of the list as it is now: publishing (LPUSH) moves messages toward its end
    # while it is read, and a count taken first would leave the last of them unread
    start = 0
    while page := r.lrange(queue, start, start + _PAGE - 1):
        start += len(page)
        for raw in page:
            tid = message_task_id(raw)
            if tid:
                ids.add(tid)
    for _, value in r.hscan_iter(keys.KOMBU_UNACKED, count=_PAGE):
        tid = message_task_id(value, unacked=True)
        if tid:
            ids.add(tid)
    return ids


@redis_errors
def broker_sample_keys(r: Client, queue: str, run_id: str) -> set[str]:
    """Sample keys of run ``run_id`` with a task queued or unacknowledged."""
    found = (sample_key_of(t, run_id) for t in broker_task_ids(r, queue))
    return {k for k in found if k is not None}


@redis_errors
def broker_depth(r: Client, queue: str) -> tuple[int, int]:
    """(messages waiting in the queue, messages delivered but not acknowledged)."""
    p = r.pipeline()
    p.llen(queue)
    p.hlen(keys.KOMBU_UNACKED)
    waiting, unacked = p.execute()
    return int(waiting), int(unacked)


QUEUE_SEEN_S = 7 * 24 * 3600.0  # a run seen on a queue this recently counts as sharing it


@redis_errors
def note_queue(r: Client, queue: str, run: str, now: float | None = None) -> list[str]:
    """Record that ``run`` uses ``queue``; the other runs seen on it lately (sharing it).

    Runs that share a queue lose nothing (a worker hands another run's message back
    untouched), but each worker takes and returns the other run's messages: say so.
    """
    now = time.time() if now is None else now
    name = keys.queue_runs(queue)
    r.hset(name, run, f"{now:.0f}")
    seen = {k.decode() if isinstance(k, bytes) else k: float(v)
            for k, v in r.hgetall(name).items()}
    return sorted(k for k, at in seen.items() if k != run and now - at < QUEUE_SEEN_S)


def sharing_warning(queue: str, run: str, others: list[str]) -> str:
    """What to tell a person whose run shares its queue with other runs."""
    return (f"queue {queue!r} (FARM_QUEUE) is shared by run {run} with run(s) "
            f"{', '.join(others)}: each worker takes the other runs' messages and hands them "
            "back untouched (nothing is lost, but work slows down). Unset FARM_QUEUE so each "
            f"run gets its own queue ({QUEUE_PREFIX}<run id>), or give each run its own name")
@redis_errors
def broker_sample_keys_at_once(index: RunIndex, queue: str) -> set[str]:
    """Sample keys of the index's run with a message queued on ``queue`` or unacknowledged,
    read at one instant (one MULTI: no message is missed moving between the two)."""
    run_id = index.run_id
    p = index.r.pipeline(transaction=True)
    p.lrange(queue, 0, -1)
    p.hvals(keys.KOMBU_UNACKED)
    queued, unacked = p.execute()
    ids = [message_task_id(m) for m in queued]
    ids += [message_task_id(m, unacked=True) for m in unacked]
    found = (sample_key_of(t, run_id) for t in ids if t)
    return {k for k in found if k is not None}


@redis_errors
def is_unacked(r: Client, tag: str) -> bool:
    """The message of delivery tag ``tag`` is delivered and not acknowledged."""
    return bool(r.hexists(keys.KOMBU_UNACKED, tag))


@redis_errors
def delivered_at(r: Client, tag: str) -> float | None:
    """When kombu delivered the unacknowledged message ``tag`` (None: it is not)."""
    at = r.zscore(keys.KOMBU_UNACKED_INDEX, tag)
    return None if at is None else float(at)


@redis_errors
def unacked_older_than(r: Client, age_s: float) -> list[str]:
    """Delivery tags of unacknowledged messages delivered more than ``age_s`` ago."""
    old: list[bytes] = r.zrange(  # type: ignore[assignment]
        keys.KOMBU_UNACKED_INDEX, 0, time.time() - age_s, byscore=True)
    return [t.decode() if isinstance(t, bytes) else t for t in old]
