"""A child process that writes a ready marker and lives for a while (argv: marker dir, seconds),
so the marker's owner is a real process the tests can keep alive or let die.
"""

from __future__ import annotations

WRITE = ("import os, sys, time; from pathlib import Path; "
         "from engine_dump.markers import write_ready_marker; "
         "write_ready_marker(Path(sys.argv[1]), {'layers_to_capture': [2, 30, 58]}); "
         "print(os.getpid(), flush=True); time.sleep(float(sys.argv[2]))")
