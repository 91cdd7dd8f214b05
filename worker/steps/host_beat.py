"""This host in its run: registered at a worker's start, then its heartbeat.

Every ``FARM_REAPER_INTERVAL_S`` a thread of the worker main process refreshes its host's
entry (``worker.state.hosts``: heartbeat, its server's state). When the entry is gone (a Redis that
lost its data came back), the host's files are registered again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from worker.core import outdir
from worker.core.errors import Transient
from worker.core.settings import Settings
from worker.state import hosts, owners
from worker.state.broker import Client
from worker.steps.base import Farm, ThreadStep, farm_of

log = logging.getLogger("hsfarm.hosts")


def register_host(r: Client, settings: Settings, run_id: str, fingerprint_id: str) -> None:
    """Register what this host's output dir holds, and say so in the log."""
    name = hosts.host_id(settings)
    got = hosts.register(r, run_id, name, settings.output_dir, fingerprint_id, settings)
    log.info("host %s: registered %d final files of %s (%d done again in the index, %d also "
             "on another host)", name, got.files, settings.output_dir, got.relearnt, got.twice)
    if got.set_aside:
        log.warning("host %s: %d final files set aside in %s: the run records them as done on "
                    "another host (this host was lost before the run learnt it had done them)",
                    name, got.set_aside, settings.output_dir / outdir.DONE_ELSEWHERE_DIR)


class HostBeat(ThreadStep):
    """The host's heartbeat, and its files registered again after Redis lost them.

    In a thread of its own, not on the worker's timer: asking the server's ``/health`` may
    take seconds, and must never delay the reaper's heartbeat on that timer."""

    thread_name = "hsfarm-host-beat"
    join_s = None  # a beat may wait seconds for the server's /health; stopping does not

    def ticker(self, worker: Any) -> tuple[Callable[[], None], float]:
        app = farm_of(worker)
        return (lambda: self.tick(app)), app.settings.reaper_interval_s

    def tick(self, app: Farm) -> None:
        settings, ctx = app.settings, app.context
        if ctx is None:
            return
        r, run_id = owners.client_for(settings), ctx.store.run_id
        try:
            registered = hosts.beat(r, run_id, hosts.host_id(settings), settings.output_dir,
                                    settings)
            hosts.remember_hosts(r, run_id, settings.output_dir)
            if not registered:  # Redis lost this host's entry: register its files again
                register_host(r, settings, run_id, ctx.fingerprint.id)
        except (Transient, OSError) as e:
            log.warning("host heartbeat: %s", e)

    def stop(self, worker: Any) -> None:
        super().stop(worker)
        app = farm_of(worker)
        settings, ctx = app.settings, app.context
        if ctx is None:
            return
        try:  # a clean stop: the host shows as stopped, not lost, once no process of it beats
            hosts.mark_stopped(owners.client_for(settings), ctx.store.run_id,
                               hosts.host_id(settings))
        except Transient as e:
            log.warning("host heartbeat: cannot say this host stopped: %s", e)
