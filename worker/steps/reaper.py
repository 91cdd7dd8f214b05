"""Bring a dead worker's messages back in seconds, not after the visibility timeout.

kombu restores an unacknowledged message only after ``FARM_VISIBILITY_TIMEOUT_S``, as it
cannot tell a dead consumer from a slow one. We can: each main process heartbeats and records
the delivery tags it receives as its own (``worker.state.owners``); every interval, a
message whose owner is gone (``liveness``), that its owner no longer holds, or unowned past
``ORPHAN_AGE_S`` goes back through ``restore_by_tag`` (a concurrent ack wins); pool processes
killed alone are Celery's. Test: tests/farm/test_crash.py::test_sigkill_worker_main_process."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.worker import state as worker_state

from worker.core import liveness
from worker.core.errors import Transient
from worker.core.settings import Settings
from worker.state import owners, queue_scan
from worker.state.broker import Client
from worker.steps.base import TimerStep, farm_of

log = logging.getLogger("hsfarm.reaper")

ORPHAN_AGE_S = 60.0


def held_tags() -> set[str]:
    """Delivery tags of the messages this worker main process holds now (Celery's state)."""
    requests = set(worker_state.reserved_requests) | set(worker_state.active_requests)
    return {str(r.message.delivery_tag) for r in requests
            if getattr(r, "message", None) is not None}


def reap(app: Celery, r: Client, held: set[str]) -> int:
    """Return to the queue the messages of gone owners, and this worker's own messages that
    it no longer holds (``held``); forget acknowledged ones. Returns how many came back."""
    me = liveness.identity()
    held_by = owners.owners(r)
    returned = _return_orphans(app, r, held_by)
    for tag, owner in held_by.items():
        if owner == me and tag in held:
            continue
        if not queue_scan.is_unacked(r, tag):
            owners.forget(r, tag, owner)  # acknowledged, or restored by kombu: nothing to do
            continue
        if owner == me:
            why = "this worker no longer holds (its acknowledgement was lost)"
        elif owners.is_gone(r, owner):
            why = f"gone worker {owner}"
        else:
            continue
        if not owners.still_theirs(r, tag, owner):
            continue
        _restore(app, tag)
        owners.forget(r, tag, owner)
        returned += 1
        log.warning("returned message %s of %s to the queue", tag, why)
    return returned


def _return_orphans(app: Celery, r: Client, held_by: dict[str, str]) -> int:
    """Unacknowledged messages older than ``ORPHAN_AGE_S`` that nobody owns (their receiver died
    between kombu recording the delivery and recording itself as their owner): back."""
    old = queue_scan.unacked_older_than(r, ORPHAN_AGE_S)
    orphans = [t for t in old if t not in held_by]
    for tag in orphans:
        _restore(app, tag)
        log.warning("returned message %s, which no worker owns, to the queue", tag)
    return len(orphans)


def _restore(app: Celery, tag: str) -> None:
    """kombu's own restore: atomic against a concurrent acknowledgement. Raises ``Transient``
    when the broker does not answer (kombu's own client, so its own error classes)."""
    with app.connection_for_write() as conn:
        try:
            conn.default_channel.qos.restore_by_tag(tag, leftmost=False)
        except conn.connection_errors + conn.channel_errors as e:
            raise Transient(f"broker: {type(e).__name__}: {e}") from e


class Reaper(TimerStep):
    """Heartbeat and reaping on the worker main process's timer."""

    def ticker(self, worker: Any) -> tuple[Callable[[], None], float]:
        settings = farm_of(worker).settings
        return (lambda: self.tick(worker.app, settings)), settings.reaper_interval_s

    def tick(self, app: Celery, settings: Settings) -> None:
        r = owners.client_for(settings)
        try:
            owners.beat(r, settings)
            reap(app, r, held_tags())
        except Transient as e:
            log.warning("reaper: %s", e)

    def stop(self, worker: Any) -> None:
        super().stop(worker)
        with contextlib.suppress(Transient):
            owners.stop_beating(owners.client_for(farm_of(worker).settings))
