"""The suite's fork server (tests/support/forkserver.py) starts a command as a plain start
would: its own session, output, environment, working directory, argv and exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.forkserver import ROOT, ForkedChild, ForkServer, serves

PROBE = "tests.support.forkprobe"
# every start's environment: the probe importable from any working directory
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def server() -> Iterator[ForkServer]:
    fs = ForkServer(module=PROBE, preload=False)
    yield fs
    fs.close()


def start(fs: ForkServer, log: Path, *args: str, env: dict[str, str] | None = None
          ) -> ForkedChild:
    child = fs([sys.executable, "-m", PROBE, *args], {**ENV, **(env or {})}, log)
    assert isinstance(child, ForkedChild)
    return child


def said(log: Path) -> dict[str, object]:
    return dict(json.loads(log.read_text().splitlines()[0]))


def test_a_forked_command_is_what_its_plain_start_would_be(server: ForkServer,
                                                            tmp_path: Path) -> None:
    # When the probe is started with an exit code, a variable of its own, from another cwd
    log = tmp_path / "probe.log"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        child = start(server, log, "exit", "3", env={"PROBE": "given"})
    finally:
        os.chdir(cwd)
    # Then it exits with that code, after its non-daemon thread and its atexit functions
    assert child.wait(30) == 3 and child.returncode == 3
    text = log.read_text()
    assert text.index("thread ended") < text.index("atexit ran"), text
    # and it ran as ``python -m`` runs it: its argv, cwd and environment, in its own session
    info = said(log)
    assert info == {"argv": ["exit", "3"], "cwd": str(tmp_path), "sid": child.pid,
                    "pid": child.pid, "probe": "given", "name": "__main__"}
    # and a second start is served too
    assert start(server, tmp_path / "again.log", "exit", "0").wait(30) == 0


def test_a_killed_or_failing_command_reports_as_popen_does(server: ForkServer,
                                                           tmp_path: Path) -> None:
    # Given a probe that sleeps
    log = tmp_path / "sleep.log"
    child = start(server, log, "sleep")
    # Then it is the fork server's child, and runs until stopped
    assert _ppid(child.pid) == server.zygotes[0].proc.pid
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.5)
    assert child.poll() is None
    # When its process group is killed, as a harness's teardown does
    os.killpg(child.pid, signal.SIGKILL)
    # Then its status is the signal's negative number
    assert child.wait(30) == -signal.SIGKILL
    # And an exception in the command is its traceback and exit code 1
    failing = start(server, tmp_path / "raise.log", "raise")
    assert failing.wait(30) == 1
    assert "RuntimeError: the probe's own error" in (tmp_path / "raise.log").read_text()


def test_each_import_environment_forks_from_a_server_begun_with_it(server: ForkServer,
                                                                     tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    assert start(server, log, "exit", "0").wait(30) == 0
    # another module, another interpreter: never the fork server's to start
    assert server([sys.executable, "-m", "json.tool"], ENV, log) is None
    assert server(["/usr/bin/python3", "-m", PROBE, "exit", "0"], ENV, log) is None
    # a variable read at import time that differs: a server begun with it forks the start
    hashed = start(server, log, "exit", "0", env={"PYTHONHASHSEED": "7"})
    assert hashed.wait(30) == 0 and len(server.zygotes) == 2
    assert server.zygotes[1].env_before["PYTHONHASHSEED"] == "7"
    # and the next start with it too, from that same server
    assert start(server, log, "exit", "0", env={"PYTHONHASHSEED": "7"}).wait(30) == 0
    assert len(server.zygotes) == 2
    # past MAX_ZYGOTES servers, a start no server serves is left to a plain start
    for n in range(3, ForkServer.MAX_ZYGOTES + 1):
        assert start(server, log, "exit", "0", env={"OMP_NUM_THREADS": str(n)}).wait(30) == 0
    assert server([sys.executable, "-m", PROBE, "exit", "0"],
                  {**ENV, "OMP_NUM_THREADS": "99"}, log) is None
    assert (server.forked, server.plain) == (ForkServer.MAX_ZYGOTES + 1, 1)


def test_a_variable_the_preload_set_itself_does_not_stop_a_fork() -> None:
    # Given a fork server begun with OMP_NUM_THREADS=1, whose torch import set its own variable
    before = {"OMP_NUM_THREADS": "1"}
    after = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"}
    # Then a command with the variables it began with, or with what the import set, forks
    assert serves({"OMP_NUM_THREADS": "1"}, before, after)
    assert serves({"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"},
                  before, after)
    # and one with another value of either, or without one it began with, does not
    assert not serves({"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"},
                      before, after)
    assert not serves({"OMP_NUM_THREADS": "2"}, before, after)
    assert not serves({}, before, after)
    assert not serves({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, before, after)


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None  # reaped already
    return int(stat.rsplit(")", 1)[1].split()[1])
