"""Which process this is, in terms that hold across machines: pid, start time, boot, pid namespace.

A pid names a process only within one pid namespace of one boot, and pids are reused, so a
process is named by pid and start time (clock ticks since boot, ``/proc``), with the boot id
(``/proc/sys/kernel/random/boot_id``: new at every boot, different on every machine) and the
pid namespace (``/proc/self/ns/pid``: containers differ). Only a process of the same boot and
namespace can be looked up in our ``/proc``. Shared by ready markers and worker liveness.
Test: tests/farm/test_markers.py::test_a_live_marker_of_another_pid_namespace_is_never_removed
"""

from __future__ import annotations

import os
import re


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> str | None:
    """The process's start time (clock ticks since boot); None when it is gone or a zombie
    (it runs no more; its parent just has not collected its exit status yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    return None if fields[0] in (b"Z", b"X") else fields[19].decode()


def boot_id() -> str:
    """This boot's id (a UUID), or "" where the kernel does not say."""
    return _read("/proc/sys/kernel/random/boot_id")


def pid_namespace() -> str:
    """This process's pid namespace as the kernel names it (``pid:[4026531836]``), or ""."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def pid_namespace_inode(name: str) -> str:
    """The inode number of a pid namespace name (``pid:[4026531836]`` → ``4026531836``)."""
    m = re.fullmatch(r"pid:\[(\d+)\]", name)
    return m.group(1) if m else ""
