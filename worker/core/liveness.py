"""Who is alive: a process identity unique per machine, and when our own /proc can tell it is gone.

An identity is ``host:pid:start:machine``: ``start`` in clock ticks since boot, ``machine`` the
boot id and pid namespace (``<boot id, 16 hex>-<pid namespace inode>``), because a hostname
names no machine (host-networked containers and cloned VMs share one). Only an identity of this
machine is judged from /proc; any other, or one without ``machine``, is left to a heartbeat or
a TTL in Redis. Test: tests/farm/test_liveness.py::
test_a_process_of_another_pid_namespace_is_never_judged_from_here."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from functools import cache

from engine_dump import process_identity as pi

HOST = socket.gethostname()
_MACHINE_RE = re.compile(r"[0-9a-f]{16}-\d+")


def _machine() -> str:
    """``<boot id>-<pid ns inode>``, or "" where the kernel does not tell both."""
    boot = pi.boot_id().replace("-", "").lower()[:16]
    ns = pi.pid_namespace_inode(pi.pid_namespace())
    machine = f"{boot}-{ns}"
    return machine if _MACHINE_RE.fullmatch(machine) else ""


MACHINE = _machine()  # a pool process shares its parent's boot and pid namespace


@dataclass(frozen=True)
class Identity:
    host: str
    pid: int
    start: str
    machine: str  # "" for an identity of the older form, which does not say

    @classmethod
    def parse(cls, ident: str) -> Identity | None:
        """Either form, or None when ``ident`` is neither (then nothing is judged)."""
        parts = ident.rsplit(":", 3)
        if len(parts) == 4 and _MACHINE_RE.fullmatch(parts[3]):
            host, pid, start, machine = parts
        elif len(parts) == 3:
            (host, pid, start), machine = parts, ""
        else:
            return None
        try:
            return cls(host, int(pid), start, machine)
        except ValueError:
            return None


@cache
def _identity_of(pid: int) -> str:
    return f"{HOST}:{pid}:{pi.start_ticks(pid) or 0}:{MACHINE or 'unknown'}"


def identity() -> str:
    """This process's identity (cached per pid: a forked child gets its own)."""
    return _identity_of(os.getpid())


def on_this_machine(ident: str) -> bool:
    """True when ``ident`` names a process whose pid our /proc can look up."""
    who = Identity.parse(ident)
    return who is not None and bool(MACHINE) and who.machine == MACHINE


def gone_here(ident: str) -> bool:
    """True when ``ident`` names a process of this machine that no longer runs."""
    who = Identity.parse(ident)
    return (who is not None and on_this_machine(ident)
            and pi.start_ticks(who.pid) != who.start)


def temp_tag(nonce: str, pid: int | None = None) -> str:
    """The writer's part of a temp file's name: ``host.m<machine>.pid.nonce``."""
    return f"{HOST}.m{MACHINE or 'unknown'}.{os.getpid() if pid is None else pid}.{nonce}"


def pid_gone_here(machine: str, pid: str) -> bool:
    """True when ``pid`` of ``machine`` (``MACHINE``'s form) is a process of this machine that
    no longer runs; False for another machine's, or where the kernel does not tell."""
    return (bool(MACHINE) and machine == MACHINE and pid.isdigit()
            and pi.start_ticks(int(pid)) is None)


def temp_writer_gone(tag: str) -> bool:
    """True when a temp file's ``temp_tag`` names a process of this machine that is gone.

    Older names (``host.pid.nonce``) do not say on which machine they were written: never
    gone here (their age decides)."""
    try:
        host, machine, pid, _ = tag.rsplit(".", 3)
        return host == HOST and pid_gone_here(machine.removeprefix("m"), pid)
    except ValueError:
        return False
