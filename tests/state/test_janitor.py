"""The dump-dir janitor on a real Redis: a dump of a sample being redone (its file was found
damaged or gone, so it is not done) is kept; a done sample's dump is an orphan, swept at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from engine_dump.dumpfile import dump_path
from engine_dump.rids import make_rid
from worker.core import outdir
from worker.core.settings import Settings
from worker.state.index import RunIndex
from worker.steps.janitor import sweep_dumps

RUN = "0123456789abcdef"


@pytest.mark.timeout(20)
def test_a_redone_samples_fresh_dump_is_kept_a_done_samples_is_swept(
        tmp_path: Path, redis_url: str) -> None:
    settings = Settings.from_env({"FARM_DUMP_DIR": str(tmp_path / "d"),
                                  "FARM_OUTPUT_DIR": str(tmp_path / "o"),
                                  "REDIS_URL": redis_url})
    settings.dump_dir.mkdir()
    index = RunIndex(redis.Redis.from_url(redis_url), RUN)
    # Given two samples whose final files are on disk: "redo" was requeued (its file failed
    # audit: not done) and an attempt's fresh dump of it waits to be collected; "done" is done
    # and a dump of an attempt abandoned earlier was left behind
    dumps = {}
    for key in ("redo", "done"):
        final = outdir.final_path(settings.output_dir, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        final.write_bytes(b"x")
        dumps[key] = dump_path(settings.dump_dir, make_rid(key, 2, 8, run=RUN))
        dumps[key].write_bytes(b"x")
    index.mark_done("done", 1, 8)
    # When the janitor sweeps (both dumps are young)
    removed = sweep_dumps(settings, RUN)
    # Then only the done sample's dump is removed
    assert removed == 1
    assert dumps["redo"].exists() and not dumps["done"].exists()


@pytest.mark.timeout(20)
def test_without_redis_the_janitor_sweeps_only_by_age(tmp_path: Path) -> None:
    # Given a done-looking sample's young dump, and a Redis that does not answer
    settings = Settings.from_env({"FARM_DUMP_DIR": str(tmp_path / "d"),
                                  "FARM_OUTPUT_DIR": str(tmp_path / "o"),
                                  "REDIS_URL": "redis://127.0.0.1:1/0"})
    settings.dump_dir.mkdir()
    final = outdir.final_path(settings.output_dir, "s1")
    final.parent.mkdir(parents=True)
    final.write_bytes(b"x")
    dump = dump_path(settings.dump_dir, make_rid("s1", 1, 8, run=RUN))
    dump.write_bytes(b"x")
    # When the janitor sweeps now, then once the dump is older than a task can wait
    kept = sweep_dumps(settings, RUN)
    later = sweep_dumps(settings, RUN, now=dump.stat().st_mtime + settings.request_timeout_s
                        + settings.dump_timeout_s + 1)
    # Then the young dump is kept (it may be a redo's), the old one removed
    assert (kept, later) == (0, 1)
