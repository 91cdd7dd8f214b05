"""strace on running server processes: which of them touch the dump dir (the live TP and DP
tests show that one process, and only it, writes each dump). Standard library only: the vLLM
tests import it from .venv-vllm."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# strace is a system package like redis-server (`make test-system-deps` installs it)
STRACE = shutil.which("strace") or "strace"


def _all_threads_traced(pid: int) -> bool:
    tasks = list(Path(f"/proc/{pid}/task").iterdir())
    return all("TracerPid:\t0\n" not in (t / "status").read_text() for t in tasks)


@contextmanager
def traced(pid: int, out: Path, attach_timeout_s: float = 60) -> Iterator[None]:
    """strace on a running process and all its threads: its file system calls, into ``out``."""
    tracer = subprocess.Popen([STRACE, "-f", "-qq", "-e", "trace=%file", "-o", str(out),
                               "-p", str(pid)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + attach_timeout_s
        while not _all_threads_traced(pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"strace did not attach to every thread of {pid}")
            time.sleep(0.1)
        yield
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(60)


def calls_on(trace: Path, directory: Path) -> list[str]:
    """The traced calls that name a path in ``directory``."""
    return [ln for ln in trace.read_text().splitlines() if str(directory) in ln]
