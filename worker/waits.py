"""Waiting out the environment's faults while holding the message: nothing is acknowledged,
no attempt is spent, and the process takes no new work until the condition clears.

Each wait polls a ``problem`` function (None when all is well, else the reason) and says in
the run index that this process is paused and why, so ``status`` can show it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable

from engine_dump import dumpdir
from worker.core import diskio, dumps, liveness
from worker.core import store as st
from worker.core.errors import Transient, server_silent
from worker.runtime import Runtime

log = logging.getLogger("hsfarm.wait")


def until_clear(rt: Runtime, key: str, problem: Callable[[], str | None], deadline: float,
                poll_s: float) -> bool:
    """Block until ``problem()`` is None (True) or until ``deadline`` (monotonic; False)."""
    reason = problem()
    if reason is None:
        return True
    t0 = time.monotonic()
    log.warning("%s paused: %s", key, reason)
    try:
        while reason is not None:
            _say_paused(rt, reason)
            if time.monotonic() + poll_s > deadline:
                log.warning("%s still paused after %.0fs; handing the message back: %s", key,
                            time.monotonic() - t0, reason)
                return False
            time.sleep(poll_s)
            reason = problem()
        log.info("%s resumed after %.1fs", key, time.monotonic() - t0)
        return True
    finally:
        _say_paused(rt, None)


def _say_paused(rt: Runtime, reason: str | None) -> None:
    # while Redis is away status cannot show it; the wait itself goes on
    with contextlib.suppress(Transient):
        rt.index.set_paused(liveness.identity(), reason)


def server_problem(rt: Runtime) -> str | None:
    """None when the server answers a cheap request (``/model_info``) in time."""
    timeout_s = min(10.0, rt.settings.request_timeout_s)
    if rt.loop.run_until_complete(rt.client.reachable(timeout_s=timeout_s)):
        return None
    return server_silent(rt.settings.server_url)


def dump_dir_problem(rt: Runtime) -> str | None:
    """None when the dump dir is there, still the server's and the workers' alone (as at
    start-up), and no dump writer of the server says it is unhealthy; else why no request may
    be sent (its dump would be lost, refused by the server, or forged) and the fix."""
    d = rt.settings.dump_dir
    if not d.is_dir():
        return dumps.dump_dir_gone(d)
    try:
        os.close(dumpdir.open_dir(d))
    except dumpdir.DumpDirUnsafe as e:  # made again by another user, opened to others...
        return str(e)
    except OSError:  # gone since
        return dumps.dump_dir_gone(d)
    return dumps.writer_problem(d)


def space_problem(rt: Runtime, need_bytes: int = 0) -> str | None:
    """None when both disks have their reserve free, plus ``need_bytes`` on the output disk."""
    s = rt.settings
    for path, reserve, what in ((s.output_dir, s.min_free_output_bytes + need_bytes,
                                 "output disk"),
                                (s.dump_dir, s.min_free_dump_bytes, "dump dir")):
        free = diskio.free_bytes(path)
        if free < reserve:
            return (f"{what} {path} low: {_mb(free)} free, waiting for {_mb(max(reserve, 1))} "
                    "(free space, or lower the reserve)")
    return None


def output_problem(rt: Runtime) -> str | None:
    """None when a file can be created, written, synced and removed in the output dir."""
    return st.writable_problem(rt.settings.output_dir)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def never_fits(rt: Runtime, need_bytes: int) -> str | None:
    """A reason when the output disk could never hold ``need_bytes``, even empty."""
    stat = os.statvfs(rt.settings.output_dir)
    total = stat.f_blocks * stat.f_frsize
    if need_bytes > total - rt.settings.min_free_output_bytes:
        return (f"needs {need_bytes} bytes; the output disk holds {total} bytes in all, less "
                f"the reserve of {rt.settings.min_free_output_bytes}")
    return None
