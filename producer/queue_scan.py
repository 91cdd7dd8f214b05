"""Which tasks are in the broker right now: waiting in the queue, or reserved/running.

This is the ground truth for "already queued or running" (no marker that could go stale): the
queue list, plus kombu's ``unacked`` hash, where every delivered-but-unacknowledged message
sits until its ack (running tasks, prefetched ones and retries waiting for their countdown).

Task ids: ``hsd-<run id>-<publication>:<sample key>`` (the run: ``worker/run.py``). The
sample key is the identity (dedupe, leases, the index); the publication number (one per
``enqueue``/``requeue`` call of the run) makes each publication of a sample a task of its
own, so a monitor that keeps task states by id (Flower: a FAILURE outranks every later state
of the same id) shows a re-enqueued sample's new attempt instead of its old outcome.
Redeliveries of one message
(``Reject(requeue=True)``, a restore) keep their id: they are the same publication.
"""

from __future__ import annotations

import orjson
import redis

from worker import keys
from worker.run import TASK_PREFIX, task_id

__all__ = ["task_id"]

_PAGE = 2000


def sample_key_of(task: str, run_id: str) -> str | None:
    """The sample key in a task id of run ``run_id``; None for any other id.

    Ids without a publication number (``hsd-<fingerprint id>-<key>``, published before
    there was one: no ``:`` in them) still name their sample: a run enqueued by an older
    version is not published twice by a newer one.
    """
    head = f"{TASK_PREFIX}-{run_id}-"
    if not task.startswith(head) or len(task) == len(head):
        return None
    rest = task[len(head):]
    publication, sep, key = rest.partition(":")
    if not sep:
        return rest  # the older format
    return key if publication.isdigit() and key else None


def _task_id(raw: bytes | str, unacked: bool = False) -> str | None:
    """The task id in a queued message, or in an ``unacked`` entry ([message, exchange, key])."""
    try:
        body = orjson.loads(raw)
        message = body[0] if unacked else body
        return str(message["headers"]["id"])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None


def broker_task_ids(r: redis.Redis, queue: str) -> set[str]:
    """Task ids queued on ``queue`` or unacknowledged anywhere (~34 MB read for 37k tasks)."""
    ids: set[str] = set()
    n = int(r.llen(queue))
    for start in range(0, n, _PAGE):
        for raw in r.lrange(queue, start, start + _PAGE - 1):
            tid = _task_id(raw)
            if tid:
                ids.add(tid)
    for _, value in r.hscan_iter(keys.KOMBU_UNACKED, count=_PAGE):
        tid = _task_id(value, unacked=True)
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
