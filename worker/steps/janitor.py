"""The dump-dir janitor: a worker bootstep that keeps tmpfs (RAM) free of orphaned dumps.

A dump is orphaned when no task will ever collect it: its attempt was abandoned (the worker
process was killed, the request timed out, the task was cancelled on a broker connection loss)
and the server finished the request afterwards. Orphans of samples whose final file exists are
removed at once; any other dump of ours is removed once it is older than the longest a task can
wait for it (request timeout + dump timeout). Runs at worker start and then every
``FARM_JANITOR_INTERVAL_S`` in the worker's main process; never touches finished outputs or
files that are not this run's: another run sharing the dump dir (a second server on the host)
keeps every dump of its own, whatever its sample keys. The dumps of a canary check whose
process was killed on this machine go at once. Probe dumps (no run) left by a dead
probe go once they are that old.

On the same timer, parked samples whose data file reads again are published again
(worker/steps/parking.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from celery import bootsteps

from sglang_patch import contracts as c
from worker.core import outdir
from worker.core.settings import Settings
from worker.server.canary_check import canary_writer_gone

log = logging.getLogger("hsfarm.janitor")


def sweep_dumps(settings: Settings, run: str, now: float | None = None) -> int:
    """Remove run ``run``'s orphaned dumps, ``.err`` files and hook temp files, and stale
    probe dumps. Returns how many."""
    now = time.time() if now is None else now
    max_age_s = settings.request_timeout_s + settings.dump_timeout_s
    removed = 0
    for p in Path(settings.dump_dir).glob("*"):
        try:
            rid = c.rid_of_file(p.name)
            if rid is None or rid.run not in (run, c.NO_RUN) or not p.is_file():
                continue
            old = now - p.stat().st_mtime > max_age_s
            finished = rid.run == run and outdir.final_path(settings.output_dir,
                                                       rid.sample_key).exists()
            if finished or old or (rid.run == run and canary_writer_gone(rid.sample_key)):
                p.unlink()
                removed += 1
        except OSError:
            continue
    if removed:
        log.info("removed %d orphaned dump files from %s", removed, settings.dump_dir)
    return removed


def _rounds(settings: Settings, run: str) -> None:
    from worker.steps.parking import resume_parked

    sweep_dumps(settings, run)
    resume_parked(settings, run)


class Janitor(bootsteps.StartStopStep):
    """Runs ``sweep_dumps`` on the worker's timer."""

    requires = ("celery.worker.components:Timer",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None

    def start(self, worker: Any) -> None:
        from worker import startup
        from worker.app import settings

        if startup.CONTEXT is None:  # worker_init did not build the run: nothing is ours
            return
        run = startup.CONTEXT.store.run_id
        _rounds(settings, run)
        self.tref = worker.timer.call_repeatedly(settings.janitor_interval_s, _rounds,
                                                 (settings, run), priority=10)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
