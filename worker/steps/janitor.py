"""The dump-dir janitor: a worker bootstep that keeps tmpfs (RAM) free of orphaned dumps.

An orphan's attempt was abandoned (killed, timed out) and the server finished it afterwards.
At start and every ``FARM_JANITOR_INTERVAL_S`` the main process removes this run's orphans: at
once when the sample is done (its file is here and the index says done: not while it is redone
after its file was found damaged) or their canary checker died here, else once older than a
task can wait; other runs' dumps stay. It also republishes parked samples (``parking``).
Tests: tests/state/test_janitor.py, tests/unit/test_liveness.py."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_dump.dumpfile import rid_of_file
from engine_dump.rids import NO_RUN
from worker.core import outdir
from worker.core.errors import ConfigError, Transient
from worker.core.settings import Settings
from worker.server.canary_check import canary_writer_gone
from worker.state import broker
from worker.state.index import RunIndex
from worker.steps.base import TimerStep, farm_of
from worker.steps.parking import resume_parked

log = logging.getLogger("hsfarm.janitor")


def sweep_dumps(settings: Settings, run: str, now: float | None = None) -> int:
    """Remove run ``run``'s orphaned dumps, ``.err`` files and hook temp files, and stale
    probe dumps. Returns how many."""
    now = time.time() if now is None else now
    max_age_s = settings.request_timeout_s + settings.dump_timeout_s
    removed = 0
    with_file: list[tuple[Path, str]] = []  # young dumps of samples whose final file is here
    for p in Path(settings.dump_dir).glob("*"):
        try:
            rid = rid_of_file(p.name)
            if rid is None or rid.run not in (run, NO_RUN) or not p.is_file():
                continue
            old = now - p.stat().st_mtime > max_age_s
            if old or (rid.run == run and canary_writer_gone(rid.sample_key)):
                p.unlink()
                removed += 1
            elif rid.run == run and outdir.final_path(settings.output_dir,
                                                      rid.sample_key).exists():
                with_file.append((p, rid.sample_key))
        except OSError:
            continue
    removed += _sweep_done(settings, run, with_file)
    if removed:
        log.info("removed %d orphaned dump files from %s", removed, settings.dump_dir)
    return removed


def _sweep_done(settings: Settings, run: str, dumps: list[tuple[Path, str]]) -> int:
    """Remove those of ``dumps`` (path, sample key) whose sample the index says is done. A
    Redis that does not answer removes none this round (the age rule still applies)."""
    if not dumps:
        return 0
    try:
        r = broker.client(settings, socket_timeout_s=5.0)
        try:
            done = RunIndex(r, run).are_done([key for _, key in dumps])
        finally:
            r.close()
    except (Transient, ConfigError) as e:
        log.info("dumps of finished samples not swept this round: %s", e)
        return 0
    removed = 0
    for (p, _), is_done in zip(dumps, done, strict=True):
        if is_done:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed += 1
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
