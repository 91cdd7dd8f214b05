"""Bring a dead worker's messages back in seconds, not after the visibility timeout.

kombu restores an unacknowledged message only after ``FARM_VISIBILITY_TIMEOUT_S``, as it
cannot tell a dead consumer from a slow one. We can: each main process heartbeats and records
the delivery tags it receives as its own (``worker.request.OwnedRequest``); every interval, a
message whose owner is gone (``liveness``), that its owner no longer holds, or unowned past
``ORPHAN_AGE_S`` goes back through ``restore_by_tag`` (a concurrent ack wins); pool processes
killed alone are Celery's. Test: tests/farm/test_crash.py::test_sigkill_worker_main_process."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.worker import state as worker_state

from worker.core import liveness
from worker.core.settings import Settings
from worker.state import broker, keys, queue_scan
from worker.steps.base import TimerStep, farm_of

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
    """Unacknowledged messages older than ``ORPHAN_AGE_S`` that nobody owns (their receiver died
    between kombu recording the delivery and recording itself as their owner): back."""
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


def forget_if_settled(r: redis.Redis, tag: str) -> None:
    """After an acknowledgement or a hand-back: forget the message, unless it is still
    unacknowledged (kombu logs and swallows a failed ack while Redis is away); then it stays
    ours, and the reaper returns it once Redis answers, since we no longer hold it."""
    if not queue_scan.is_unacked(r, tag):
        forget(r, tag, liveness.identity())


_CLIENTS: dict[str, redis.Redis] = {}


def client_for(settings: Settings) -> redis.Redis:
    """One client per Redis URL in this process, shared by the steps and each request."""
    client = _CLIENTS.get(settings.redis_url)
    if client is None:
        client = _CLIENTS[settings.redis_url] = _client(settings)
    return client


class Reaper(TimerStep):
    """Heartbeat and reaping on the worker main process's timer."""

    def ticker(self, worker: Any) -> tuple[Callable[[], None], float]:
        settings = farm_of(worker).settings
        return (lambda: self.tick(worker.app, settings)), settings.reaper_interval_s

    def tick(self, app: Celery, settings: Settings) -> None:
        r = client_for(settings)
        try:
            beat(r, settings)
            reap(app, r, held_tags())
        except redis.RedisError as e:
            log.warning("reaper: redis: %s", e)

    def stop(self, worker: Any) -> None:
        super().stop(worker)
        with contextlib.suppress(redis.RedisError):
            client_for(farm_of(worker).settings).delete(heartbeat_key(liveness.identity()))
