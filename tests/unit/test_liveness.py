"""The janitor sweeps only the canary dumps of a process gone from this machine: not a live
one's, not another machine's, not another run's. One finished child process; no Redis.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker.core import liveness


def test_the_janitor_sweeps_a_killed_canary_checkers_dumps_only(tmp_path: Path) -> None:
    from engine_dump.dumpfile import dump_path
    from engine_dump.rids import make_rid
    from worker.core.settings import Settings
    from worker.server.canary_check import canary_key
    from worker.steps.janitor import sweep_dumps

    # Given a dump dir holding canary dumps of this run from a process that is gone, of this
    # live process, of another machine, and a gone process's dump of another run
    settings = Settings.from_env({"FARM_DUMP_DIR": str(tmp_path / "d"),
                                  "FARM_OUTPUT_DIR": str(tmp_path / "o")})
    settings.dump_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    gone = canary_key(0).replace(f"_{os.getpid()}_", f"_{proc.pid}_")
    other_machine = gone.replace(f"_m{liveness.MACHINE}_", "_m0123456789abcdef-1_")
    run_a, run_b = "0123456789abcdef", "fedcba9876543210"
    names = {k: dump_path(settings.dump_dir, make_rid(k, 1, 8, run=run_a)).name
             for k in (gone, canary_key(1), other_machine)}
    foreign = dump_path(settings.dump_dir, make_rid(gone, 1, 8, run=run_b)).name
    for name in [*names.values(), foreign]:
        (settings.dump_dir / name).write_bytes(b"x")
    # When run a's janitor sweeps (every file is young)
    removed = sweep_dumps(settings, run_a)
    # Then only the gone checker's dump of run a is removed
    assert removed == 1
    left = sorted(p.name for p in settings.dump_dir.iterdir())
    assert left == sorted([n for k, n in names.items()
                           if k != gone] + [foreign])
