"""The dump-dir janitor: a worker bootstep that keeps tmpfs (RAM) free of orphaned dumps.

A dump is orphaned when its attempt was abandoned (killed, timed out, cancelled) and the
server finished the request afterwards. At start and every ``FARM_JANITOR_INTERVAL_S`` the
main process removes this run's orphans: at once when the sample is done or their canary
checker died here, else once older than a task can wait (request + dump timeout); another
run's dumps in a shared dump dir stay. It also republishes parked samples (``parking``).
Test: tests/unit/test_liveness.py::test_the_janitor_sweeps_a_killed_canary_checkers_dumps_only."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_dump import contracts as c
from worker.core import outdir
from worker.core.settings import Settings
from worker.server.canary_check import canary_writer_gone
from worker.steps.base import TimerStep, farm_of
from worker.steps.parking import resume_parked

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


class Janitor(TimerStep):
    """Runs ``sweep_dumps`` and ``resume_parked`` on the worker's timer."""

    def ticker(self, worker: Any) -> tuple[Callable[[], None], float] | None:
        app = farm_of(worker)
        if app.context is None:  # worker_init did not build the run: nothing is ours
            return None
        settings, run = app.settings, app.context.store.run_id

        def rounds() -> None:
            sweep_dumps(settings, run)
            resume_parked(settings, run, worker.app)

        return rounds, settings.janitor_interval_s
