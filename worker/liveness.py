"""Who is alive: a process identity that survives pid reuse, and how to tell it is gone.

An identity is ``host:pid:start`` (``start``: the process's start time in clock ticks since
boot, from ``/proc``). A process on this host is gone when no process has that pid with that
start time; a process on another host cannot be checked from here, so callers pair this with
a heartbeat or a TTL.
"""

from __future__ import annotations

import os
import socket
from functools import cache

HOST = socket.gethostname()


def _start_ticks(pid: int) -> str | None:
    """The process's start time, or None when it is gone (a zombie is gone: it runs no more,
    its parent just has not collected its exit status yet)."""
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()  # noqa: SIM115 (tiny, read at once)
    except OSError:
        return None
    # after the command name (which may hold spaces and parentheses): state, ..., starttime
    fields = stat.rsplit(b")", 1)[1].split()
    return None if fields[0] in (b"Z", b"X") else fields[19].decode()


@cache
def _identity_of(pid: int) -> str:
    return f"{HOST}:{pid}:{_start_ticks(pid) or 0}"


def identity() -> str:
    """This process's identity (cached per pid: a forked child gets its own)."""
    return _identity_of(os.getpid())


def host_of(ident: str) -> str:
    return ident.rsplit(":", 2)[0]


def gone_here(ident: str) -> bool:
    """True when ``ident`` names a process of this host that no longer runs."""
    try:
        host, pid, start = ident.rsplit(":", 2)
        return host == HOST and _start_ticks(int(pid)) != start
    except ValueError:
        return False
