"""Bring a dead worker's messages back in seconds, not after the visibility timeout.

kombu keeps every delivered, unacknowledged message in Redis (``unacked``) and puts it back in
the queue only once it is ``FARM_VISIBILITY_TIMEOUT_S`` old (20 minutes by default), because
it cannot tell a dead consumer from a slow one. We can:

- each worker main process has an identity (``liveness.identity()``) and a heartbeat key it
  refreshes every ``FARM_REAPER_INTERVAL_S``, with a TTL of ``FARM_HEARTBEAT_TTL_S``;
- when it receives a task message, it records the message's delivery tag as its own
  (``hsfarm:owners``), and forgets it once the message is acknowledged or handed back
  (``OwnedRequest``, the task's Request class);
- every interval, each worker looks at the owners: a message whose owner is gone (a process
  of this machine that no longer runs, or, for one of another machine or pid namespace,
  whatever its hostname, a heartbeat that expired) goes back to the front of
  the queue through kombu's own ``restore_by_tag`` (WATCH/MULTI on the unacked hash, so a
  concurrent acknowledgement wins and nothing is restored twice). A gone owner cannot
  acknowledge late;
- a message this worker owns but no longer holds (its acknowledgement or hand-back failed
  while Redis was away, and Celery forgot it) goes back the same way, and so does one with
  no owner at all once it is older than ``ORPHAN_AGE_S`` (its receiver died between kombu
  recording the delivery and the receiver recording itself as its owner).

Pool processes killed alone are already handled by Celery (``task_reject_on_worker_lost``);
this is for the main process (SIGKILL, OOM killer, a host that died).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import redis
from celery import Celery, bootsteps
from celery.worker import state as worker_state
from celery.worker.request import Request

from worker.core import liveness, time_limits
from worker.core.settings import Settings
from worker.state import broker, keys, queue_scan

log = logging.getLogger("hsfarm.reaper")

# Forget an owner entry only while it still names that owner (another worker may own the tag
# by now: the same message, delivered again).
ORPHAN_AGE_S = 60.0
DELIVERY_SETTLE_S = 2.0  # a delivery this fresh may not have recorded its owner yet
_FORGET = "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then " \
          "return redis.call('HDEL', KEYS[1], ARGV[1]) else return 0 end"


def heartbeat_key(owner: str) -> str:
    return f"{keys.HEARTBEAT}:{owner}"


def beat(r: redis.Redis, settings: Settings) -> None:
    """Say that this worker main process is alive (for ``heartbeat_ttl_s``)."""
    r.set(heartbeat_key(liveness.identity()), "1", ex=max(1, int(settings.heartbeat_ttl_s)))


def is_gone(r: redis.Redis, owner: str) -> bool:
    """A worker of this machine: its process no longer runs. Anywhere else (another boot or
    pid namespace, whatever its hostname), or an identity that does not say where it ran:
    its heartbeat expired."""
    if liveness.on_this_machine(owner):
        return liveness.gone_here(owner)
    return not r.exists(heartbeat_key(owner))


def held_tags() -> set[str]:
    """Delivery tags of the messages this worker main process holds now (Celery's state)."""
    requests = set(worker_state.reserved_requests) | set(worker_state.active_requests)
    return {str(r.message.delivery_tag) for r in requests
            if getattr(r, "message", None) is not None}


def reap(app: Celery, r: redis.Redis, held: set[str]) -> int:
    """Return to the queue the messages of gone owners, and this worker's own messages that
    it no longer holds (``held``); forget acknowledged ones. Returns how many came back."""
    me = liveness.identity()
    owners = {_text(t): _text(o) for t, o in r.hgetall(keys.OWNERS).items()}
    returned = _return_orphans(app, r, owners)
    for tag, owner in owners.items():
        if owner == me and tag in held:
            continue
        if not queue_scan.is_unacked(r, tag):
            forget(r, tag, owner)  # acknowledged, or restored by kombu: nothing to do
            continue
        if owner == me:
            why = "this worker no longer holds (its acknowledgement was lost)"
        elif is_gone(r, owner):
            why = f"gone worker {owner}"
        else:
            continue
        if not _still_theirs(r, tag, owner):
            continue
        _restore(app, tag)
        forget(r, tag, owner)
        returned += 1
        log.warning("returned message %s of %s to the queue", tag, why)
    return returned


def _still_theirs(r: redis.Redis, tag: str, owner: str) -> bool:
    """Read again just before restoring: is the message still ``owner``'s delivery?

    Between the reading of the owners and now, another reaper may have restored it and a live
    worker received it again (same delivery tag): kombu records that delivery a few ms before
    the receiver records itself as the owner, and restoring it would put a second copy of a
    running sample in the queue. A delivery younger than ``DELIVERY_SETTLE_S`` is left to the
    next round, when its owner is known.
    """
    current = r.hget(keys.OWNERS, tag)
    at = queue_scan.delivered_at(r, tag)
    return (current is not None and _text(current) == owner and at is not None
            and time.time() - at >= DELIVERY_SETTLE_S)


def _return_orphans(app: Celery, r: redis.Redis, owners: dict[str, str]) -> int:
    """Unacknowledged messages older than ``ORPHAN_AGE_S`` that nobody owns: back."""
    old = queue_scan.unacked_older_than(r, ORPHAN_AGE_S)
    orphans = [t for t in old if t not in owners]
    for tag in orphans:
        _restore(app, tag)
        log.warning("returned message %s, which no worker owns, to the queue", tag)
    return len(orphans)


def _restore(app: Celery, tag: str) -> None:
    """kombu's own restore: atomic against a concurrent acknowledgement."""
    with app.connection_for_write() as conn:
        conn.default_channel.qos.restore_by_tag(tag, leftmost=False)


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _client(settings: Settings) -> redis.Redis:
    return broker.client(settings, socket_timeout_s=10)


def forget(r: redis.Redis, tag: str, owner: str) -> None:
    r.eval(_FORGET, 1, keys.OWNERS, tag, owner)


def _forget_if_settled(r: redis.Redis, tag: str) -> None:
    """After an acknowledgement or a hand-back: forget the message, unless it is still
    unacknowledged (kombu logs and swallows a failed ack while Redis is away); then it stays
    ours, and the reaper returns it once Redis answers, since we no longer hold it."""
    if not queue_scan.is_unacked(r, tag):
        forget(r, tag, liveness.identity())


class OwnedRequest(Request):
    """A task request that records, in the worker main process, who holds its message."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        self._owner_call(lambda r, tag: r.hset(keys.OWNERS, tag, liveness.identity()))
        self._size_time_limits()

    def _size_time_limits(self) -> None:
        """This delivery's time limits, from its record's size (worker/core/time_limits.py)."""
        from worker.app import settings
        from worker.startup import CONTEXT

        try:
            record_bytes = int(self.args[0]["n"])
        except (IndexError, KeyError, TypeError, ValueError):
            return  # not a sample reference: the task refuses it under the app's limits
        if CONTEXT is None or record_bytes < 1:
            return
        limits = time_limits.for_record(settings, record_bytes, CONTEXT.limits.bytes_per_token)
        self.time_limits = limits.as_celery()
        self._request_dict["timelimit"] = limits.as_celery()  # the task's self.request sees it

    def acknowledge(self) -> None:
        super().acknowledge()
        self._owner_call(_forget_if_settled)

    def reject(self, requeue: bool = False) -> None:
        super().reject(requeue=requeue)
        self._owner_call(_forget_if_settled)

    def _owner_call(self, fn: Any) -> None:
        from worker.app import settings

        tag = getattr(self.message, "delivery_tag", None)
        if tag is None:
            return
        try:
            fn(_client_for(settings), tag)
        except redis.RedisError as e:  # the visibility timeout still covers this message
            log.warning("cannot record the owner of message %s: %s", tag, e)


_CLIENTS: dict[str, redis.Redis] = {}


def _client_for(settings: Settings) -> redis.Redis:
    client = _CLIENTS.get(settings.redis_url)
    if client is None:
        client = _CLIENTS[settings.redis_url] = _client(settings)
    return client


class Reaper(bootsteps.StartStopStep):
    """Heartbeat and reaping on the worker main process's timer."""

    requires = ("celery.worker.components:Timer",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None

    def start(self, worker: Any) -> None:
        from worker.app import settings

        self.tick(worker.app, settings)
        self.tref = worker.timer.call_repeatedly(settings.reaper_interval_s, self.tick,
                                                 (worker.app, settings), priority=10)

    def tick(self, app: Celery, settings: Settings) -> None:
        r = _client_for(settings)
        try:
            beat(r, settings)
            reap(app, r, held_tags())
        except redis.RedisError as e:
            log.warning("reaper: redis: %s", e)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
        from worker.app import settings

        with contextlib.suppress(redis.RedisError):
            _client_for(settings).delete(heartbeat_key(liveness.identity()))
