"""The dump-dir janitor: a worker bootstep that keeps tmpfs (RAM) free of orphaned dumps.

A dump is orphaned when no task will ever collect it: its attempt was abandoned (the worker
process was killed, the request timed out, the task was cancelled on a broker connection loss)
and the server finished the request afterwards. Orphans of samples whose final file exists are
removed at once; any other dump of ours is removed once it is older than the longest a task can
wait for it (request timeout + dump timeout). Runs at worker start and then every
``FARM_JANITOR_INTERVAL_S`` in the worker's main process; never touches finished outputs or
files that are not ours.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from celery import bootsteps

from sglang_patch import contracts as c
from worker.settings import Settings

log = logging.getLogger("hsfarm.janitor")


def sweep_dumps(settings: Settings, now: float | None = None) -> int:
    """Remove orphaned dumps, ``.err`` files and hook temp files. Returns how many."""
    now = time.time() if now is None else now
    max_age_s = settings.request_timeout_s + settings.dump_timeout_s
    removed = 0
    for p in Path(settings.dump_dir).glob("*"):
        try:
            if not p.is_file():
                continue
            age_s = now - p.stat().st_mtime
            rid = c.parse_rid(p.name.rsplit(".", 1)[0])
            finished = rid is not None and c.final_path(settings.output_dir,
                                                        rid.sample_key).exists()
            ours = rid is not None or (c.is_temp_name(p.name) and p.name.startswith("."))
            if ours and (finished or age_s > max_age_s) and not p.name.startswith(c.READY_PREFIX):
                p.unlink()
                removed += 1
        except OSError:
            continue
    if removed:
        log.info("removed %d orphaned dump files from %s", removed, settings.dump_dir)
    return removed


class Janitor(bootsteps.StartStopStep):
    """Runs ``sweep_dumps`` on the worker's timer."""

    requires = ("celery.worker.components:Timer",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None

    def start(self, worker: Any) -> None:
        from worker.app import settings

        sweep_dumps(settings)
        self.tref = worker.timer.call_repeatedly(settings.janitor_interval_s, sweep_dumps,
                                                 (settings,), priority=10)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
