"""Which tasks are in the broker right now: waiting in the queue, or reserved/running.

This is the ground truth for "already queued or running" (no marker that could go stale): the
queue list, plus kombu's ``unacked`` hash, where every delivered-but-unacknowledged message
sits until its ack (running tasks, prefetched ones and retries waiting for their countdown).

Task ids: ``hsd-<run id>-<publication>:<sample key>`` (the run: ``worker/core/run.py``). The
sample key is the identity (dedupe, leases, the index); the publication number (one per
``enqueue``/``requeue`` call of the run) makes each publication of a sample a task of its
own, so a monitor that keeps task states by id (Flower: a FAILURE outranks every later state
of the same id) shows a re-enqueued sample's new attempt instead of its old outcome.
Redeliveries of one message
(``Reject(requeue=True)``, a restore) keep their id: they are the same publication.
"""

from __future__ import annotations

import time

import redis

from worker.core.run import message_task_id, sample_key_of, task_id
from worker.state import keys

__all__ = ["broker_depth", "broker_sample_keys", "broker_sample_keys_at_once", "broker_task_ids",
           "delivered_at", "is_unacked", "sample_key_of", "task_id", "unacked_older_than"]

_PAGE = 2000


def broker_task_ids(r: redis.Redis, queue: str) -> set[str]:
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


def broker_sample_keys(r: redis.Redis, queue: str, run_id: str) -> set[str]:
    """Sample keys of run ``run_id`` with a task queued or unacknowledged."""
    found = (sample_key_of(t, run_id) for t in broker_task_ids(r, queue))
    return {k for k in found if k is not None}


def broker_depth(r: redis.Redis, queue: str) -> tuple[int, int]:
    """(messages waiting in the queue, messages delivered but not acknowledged)."""
    p = r.pipeline()
    p.llen(queue)
    p.hlen(keys.KOMBU_UNACKED)
    waiting, unacked = p.execute()
    return int(waiting), int(unacked)


def broker_sample_keys_at_once(r: redis.Redis, queue: str, run_id: str) -> set[str]:
    """Sample keys of run ``run_id`` with a message queued on ``queue`` or unacknowledged,
    read at one instant (one MULTI: no message is missed moving between the two)."""
    p = r.pipeline(transaction=True)
    p.lrange(queue, 0, -1)
    p.hvals(keys.KOMBU_UNACKED)
    queued, unacked = p.execute()
    ids = [message_task_id(m) for m in queued]
    ids += [message_task_id(m, unacked=True) for m in unacked]
    found = (sample_key_of(t, run_id) for t in ids if t)
    return {k for k in found if k is not None}


def is_unacked(r: redis.Redis, tag: str) -> bool:
    """The message of delivery tag ``tag`` is delivered and not acknowledged."""
    return bool(r.hexists(keys.KOMBU_UNACKED, tag))


def delivered_at(r: redis.Redis, tag: str) -> float | None:
    """When kombu delivered the unacknowledged message ``tag`` (None: it is not)."""
    at = r.zscore(keys.KOMBU_UNACKED_INDEX, tag)
    return None if at is None else float(at)


def unacked_older_than(r: redis.Redis, age_s: float) -> list[str]:
    """Delivery tags of unacknowledged messages delivered more than ``age_s`` ago."""
    old: list[bytes] = r.zrange(  # type: ignore[assignment]
        keys.KOMBU_UNACKED_INDEX, 0, time.time() - age_s, byscore=True)
    return [t.decode() if isinstance(t, bytes) else t for t in old]
