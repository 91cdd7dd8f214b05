"""A command for tests/unit/test_forkserver.py: says what it was started as, then does what
its first argument asks (``exit N``, ``sleep``, ``raise``)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "sid": os.getsid(0),
                  "pid": os.getpid(), "probe": os.environ.get("PROBE"),
                  "name": __name__}), flush=True)
atexit.register(lambda: print("atexit ran", flush=True))


def _late() -> None:
    time.sleep(0.2)
    print("thread ended", flush=True)


# a non-daemon thread: an interpreter's exit waits for it, so the child's must too
threading.Thread(target=_late).start()
what = sys.argv[1]
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "sleep":
    time.sleep(120)
if what == "raise":
    raise RuntimeError("the probe's own error")
