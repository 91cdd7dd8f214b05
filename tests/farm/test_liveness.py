"""Who is alive: a process identity unique per machine (boot id and pid namespace), so a
process of another machine with the same hostname is never judged dead from our own /proc.
Real processes, real pid namespaces (``unshare``), a real Redis and real workers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_dump.dumpfile import is_temp_name
from producer.localfarm.farm import wait_until
from tests.conftest import assert_farm_invariants, wait_finished
from tests.support.faults import attempts, enqueue, running_farm, text
from worker.core import liveness
from worker.state import keys as reaper_keys

NEEDS_PID_NS = pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                  reason="needs unshare(1) and root for a new pid namespace")
IN_OTHER_PID_NS = ["unshare", "--pid", "--fork", "--mount-proc"]
IDENTITY = "from worker.core import liveness; print(liveness.identity(), flush=True)"


def _identity(prefix: list[str], sleep_s: float = 0) -> tuple[subprocess.Popen[str], str]:
    """A process (under ``prefix``) that prints its identity, then sleeps ``sleep_s``."""
    proc = subprocess.Popen([*prefix, sys.executable, "-c",
                             f"{IDENTITY}; import time; time.sleep({sleep_s})"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_gone_process_of_this_machine_is_gone_a_live_one_is_not() -> None:
    # Given an exited process of this machine, and this live one
    proc, ident = _identity([])
    proc.wait(30)
    # Then the first is gone, this one is not
    assert liveness.gone_here(ident)
    assert not liveness.gone_here(liveness.identity())
    # And an identity of the form an older worker wrote (host:pid:start), which does not say
    # on which machine it ran, is never judged from here: its TTL or heartbeat decides
    old = ":".join(ident.split(":")[:3])
    assert not liveness.gone_here(old) and not liveness.on_this_machine(old)


@NEEDS_PID_NS
def test_a_process_of_another_pid_namespace_is_never_judged_from_here() -> None:
    # Given a process of another pid namespace with our hostname, alive, then exited
    proc, ident = _identity(IN_OTHER_PID_NS, sleep_s=30)
    try:
        assert ident.startswith(f"{liveness.HOST}:")
        # Then it is not of this machine, and not gone (its pid here names another process)
        assert not liveness.on_this_machine(ident) and not liveness.gone_here(ident)
    finally:
        proc.kill()
        proc.wait()
    assert not liveness.gone_here(ident)  # gone indeed, but only its heartbeat can say so


@NEEDS_PID_NS
def test_two_workers_of_one_hostname_in_two_pid_namespaces_take_nothing_from_each_other(
        tmp_path: Path) -> None:
    # Given two workers with one hostname in two pid namespaces (two containers with host
    # networking, two VMs cloned from one image), sharing Redis, server and output dir;
    # samples slow enough (2 s between a file's write and its rename) that each one's
    # messages are seen by the other's reaper, and its temp files by the other's start-up
    env = {"FARM_DEBUG_WRITE_DELAY_S": "2", "FARM_REAPER_INTERVAL_S": "1",
           "FARM_HEARTBEAT_TTL_S": "3", "FARM_LEASE_TTL_S": "5"}
    with running_farm(tmp_path, env=env) as farm:
        a = farm.start_worker("a", concurrency=2, prefix=IN_OTHER_PID_NS)
        keys = enqueue(farm, tmp_path, 16)
        wait_until(lambda: any((farm.output_dir / "samples").rglob(".*")), 60,
                   "a to write a temp file")
        b = farm.start_worker("b", concurrency=2, prefix=IN_OTHER_PID_NS)
        # When they run the samples side by side
        wait_finished(farm, 16, timeout_s=150)
        # Then neither returned the other's messages, took a lease over, or lost one
        logs = a.log.read_text() + b.log.read_text()
        thefts = {t: logs.count(t) for t in ("returned message", "took over", "was lost",
                                             "stale temp files")}
        spent = attempts(farm)
        assert not any(thefts.values()) and spent == dict.fromkeys(keys, 1), (thefts, spent)
        # And every sample was extracted once, into exactly one verified file
        assert_farm_invariants(farm, keys)

        # When one of them dies holding messages (SIGKILL of its whole pid namespace)
        more = enqueue(farm, tmp_path, 6, start=16)
        r = farm.redis()
        wait_until(lambda: len({text(o) for o in r.hvals(reaper_keys.OWNERS)}) == 2, 60,
                   "both workers to hold messages")
        a_ns = os.stat(f"/proc/{a.children()[0]}/ns/pid").st_ino  # unshare's child: a's worker

        def a_temps() -> list[Path]:  # temp_tag: host.m<boot>-<pid ns>.pid.nonce
            return [t for t in (farm.output_dir / "samples").rglob(".*")
                    if is_temp_name(t.name) and f"-{a_ns}." in t.name]

        wait_until(lambda: bool(a_temps()), 60, "a to be writing a file", poll_s=0.05)
        a.kill_group()
        mid_write = a_temps()
        # Then the other returns them once a's heartbeat has expired, and runs them
        wait_finished(farm, 22, timeout_s=90)
        assert "returned message" in b.log.read_text()
        # And no temp file a left mid-write is left: from b's pid namespace its writer's death
        # cannot be told, but b writes each of those samples holding its lease, and a temp
        # file of a sample whose lease another holds is a dead or lease-less writer's
        assert mid_write and not [t for t in mid_write if t.exists()], mid_write
        assert_farm_invariants(farm, keys + more)
