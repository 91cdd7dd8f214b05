"""A Redis outage costs no attempt.

When Redis stops answering, Celery cancels the tasks this worker runs (``worker_cancel_long_
running_tasks_on_connection_loss``); their messages come back later (``reaper``), but each
attempt was counted at its start and cannot refund itself. So a thread of each main process
PINGs Redis every second and remembers its attempts' ``running`` entries; once Redis answers
after a failed PING, each not running here any more is refunded (``RunIndex.refund_running``).
Test: tests/farm/test_reconciler.py::test_redis_killed_mid_run_loses_nothing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from worker.core import run as runs
from worker.core.errors import Transient
from worker.state import broker, hosts, keys
from worker.state.broker import Client
from worker.state.index import RunIndex
from worker.steps.base import ThreadStep, farm_of

log = logging.getLogger("hsfarm.outage")

PING_EVERY_S = 1.0


def running_here(run_id: str) -> set[str]:
    """Sample keys of the tasks this worker main process runs now (Celery's state)."""
    for _ in range(3):  # the event loop may change the set while this thread copies it
        try:
            requests = list(worker_state.active_requests)
            break
        except RuntimeError:
            continue
    else:
        return set()
    found = (runs.sample_key_of(str(r.id), run_id) for r in requests)
    return {k for k in found if k is not None}


class Watch:
    """Remembers this worker's running entries while Redis answers; refunds after an outage.

    ``host``, ``pool_pids``: how this main process's pool children name themselves in their
    ``running`` entries (``host:pid``), so an attempt begun after the last tick that saw Redis
    (up to ``PING_EVERY_S`` before it went) is refunded too; ``running``: ``running_here``."""

    def __init__(self, r: Client, run_id: str, host: str = "",
                 pool_pids: Callable[[], set[int]] = set,
                 running: Callable[[str], set[str]] = running_here) -> None:
        self.r, self.run_id, self.host = r, run_id, host
        self.pool_pids, self.running = pool_pids, running
        self.index = RunIndex(r, run_id)
        self.remembered: dict[str, bytes | str] = {}
        self.ours: set[str] = set()  # the pool children's names when Redis last answered
        self.away = False
        self.lost_at = 0.0  # when a PING first failed

    def tick(self) -> int:
        """One PING; returns the attempts refunded (after an outage), else 0."""
        try:
            broker.ping(self.r)
            mine = self.running(self.run_id)
            bodies = self.index.running_bodies(sorted(mine))
            refunded = self._refund(mine) if self.away else 0
        except Transient:
            if not self.away:
                log.warning("Redis does not answer: tasks in flight are cancelled and handed "
                            "back when it does; their attempts are refunded")
                self.away, self.lost_at = True, time.time()
            return 0
        self.away = False
        self.remembered = {k: b for k, b in zip(sorted(mine), bodies, strict=True) if b}
        self.ours = {f"{self.host}:{pid}" for pid in self.pool_pids()} if self.host else set()
        return refunded

    def _refund(self, still_running: set[str]) -> int:
        refunded = 0
        for key, body in {**self._begun_unseen(still_running), **self.remembered}.items():
            if key in still_running:
                continue
            if self.index.refund_running(key, body):
                refunded += 1
                log.warning("%s attempt refunded: cancelled when Redis went away", key)
        return refunded

    def _begun_unseen(self, still_running: set[str]) -> dict[str, bytes | str]:
        """Running entries of this process's pool children begun before Redis went away and
        not remembered (begun after the last tick that saw it), none of them running now.
        An attempt begun since Redis came back is newer than ``lost_at``: never taken."""
        found = {k: b for k, b in self.index.outcomes(keys.RUNNING).items()
                 if b.get("worker") in self.ours and float(b.get("since", 0)) < self.lost_at
                 and k not in still_running and k not in self.remembered}
        raw = self.index.running_bodies(sorted(found))
        return {k: b for k, b in zip(sorted(found), raw, strict=True) if b is not None}


def pool_pids(worker: Any) -> set[int]:
    """The pids of the worker's pool processes now (Celery's prefork pool; none for others)."""
    try:
        return {int(p) for p in worker.pool.info.get("processes", [])}
    except Exception:  # a pool of another kind, or one changing under this thread
        return set()


class OutageStep(ThreadStep):
    """Runs ``Watch.tick`` every ``PING_EVERY_S`` on a thread of the worker main process."""

    thread_name = "hsfarm-outage"

    def ticker(self, worker: Any) -> tuple[Callable[[], None], float] | None:
        app = farm_of(worker)
        if app.context is None:
            return None
        watch = Watch(broker.client(app.settings, socket_timeout_s=5), app.context.store.run_id,
                      host=hosts.host_id(app.settings), pool_pids=lambda: pool_pids(worker))

        def tick() -> None:
            try:
                watch.tick()
            except Exception:  # never let the thread die
                log.exception("outage watch failed")

        return tick, PING_EVERY_S
