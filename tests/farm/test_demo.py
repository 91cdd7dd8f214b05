"""``python -m producer demo`` as a new user runs it: from the repo root, without ``REDIS_URL``
or any ``FARM_*`` setting. It keeps to a Redis of its own, stores what it is told to (bf16 or
fp8), and ends with commands that look at its run; each works as printed once it has stopped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import redis

from engine_dump.dumpfile import DTYPE_FP8, DUMP_SUFFIX, T_HIDDEN
from producer.localfarm.farm import wait_until
from tests.conftest import ROOT, write_samples
from tests.support.chromium import chromium
from worker.core import tensorfile
from worker.core.run import read_run_id

N = 8  # samples: enough for two workers, few enough for a test
DEFAULT_REDIS_PORT = 6379  # where Settings' default REDIS_URL points


def user_env(**extra: str) -> dict[str, str]:
    """A shell's environment with none of the farm's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_") and k != "REDIS_URL"}
    return {**env, **extra}


def run_demo(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    data = tmp / "data.json"
    write_samples(data, N)
    return subprocess.run([sys.executable, "-m", "producer", "demo", "--work-dir",
                           str(tmp / "demo"), "--data", str(data), *args], cwd=ROOT,
                          env=user_env(**env), capture_output=True, text=True, timeout=600)


def look_commands(stdout: str) -> list[str]:
    """The shell lines the demo prints at its end, under its "look at the run" step."""
    _, sep, tail = stdout.partition("==> look at the run")
    assert sep, stdout[-3000:]
    return [line.strip() for line in tail.splitlines()[1:] if line.startswith("    ")]


def shell(export: str, line: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``line`` typed into a shell at the repo root after the ``export`` line."""
    return subprocess.run(["bash", "-c", f"set -e\n{export}\n{line}"], cwd=ROOT, env=user_env(),
                          capture_output=True, text=True, timeout=timeout_s)


@contextmanager
def default_redis(tmp: Path) -> Iterator[redis.Redis]:
    """The Redis at the default REDIS_URL's address: the one listening there, or, where none
    does, a redis-server started there for the test."""
    r = redis.Redis(port=DEFAULT_REDIS_PORT, socket_timeout=5)
    try:
        r.ping()
    except redis.AuthenticationError:
        pytest.skip("the Redis on 6379 wants a password: cannot watch its keys")
    except redis.ConnectionError:
        pass
    else:
        yield r
        return
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port",
                             str(DEFAULT_REDIS_PORT), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: _pings(r), 20, "a redis-server on 6379")
        yield r
    finally:
        proc.kill()
        proc.wait(10)


def _pings(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.ConnectionError:
        return False


@contextmanager
def restarted_redis(cmds: list[str]) -> Iterator[tuple[str, list[str]]]:
    """Run the printed line that restarts the demo's Redis; yield the export line and the
    commands after it; run the printed shutdown line at the end (whatever happened)."""
    restart, export, *rest = cmds
    assert restart.startswith("redis-server ") and "--daemonize yes" in restart, cmds
    assert export.startswith("export ") and rest[-1].startswith("redis-cli "), cmds
    res = subprocess.run(["bash", "-c", restart], cwd=ROOT, env=user_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        yield export, rest[:-1]
    finally:
        stop = subprocess.run(["bash", "-c", rest[-1]], cwd=ROOT, env=user_env(),
                              capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stdout + stop.stderr


@pytest.mark.timeout(900)
def test_the_demo_keeps_to_its_own_redis_and_its_printed_commands_work(
        tmp_path: Path, tiny_model: Path) -> None:
    # Given a Redis on the default URL's address, and no REDIS_URL in the environment
    with default_redis(tmp_path) as default:
        before = set(default.keys("*"))
        # When a new user runs the demo
        res = run_demo(tmp_path)
        # Then it runs on a private Redis and leaves the default one as it was
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        assert "started a private redis-server" in res.stdout, res.stdout
        run_id = read_run_id(tmp_path / "demo" / "out")
        assert run_id is not None
        new = {str(k) for k in set(default.keys("*")) - before}
        assert not {k for k in new if "hsfarm" in k or run_id in k}, new
        assert not default.keys(f"*{run_id}*")
    # And it ends with the commands that look at its run, every setting they need named
    cmds = look_commands(res.stdout)
    assert [re.sub(r"^\S+ -m producer (\w+).*", r"\1", x) for x in cmds[2:-1]] == \
        ["status", "audit", "export", "dashboard"], cmds
    assert f"FARM_OUTPUT_DIR={tmp_path / 'demo' / 'out'}" in cmds[1], cmds[1]
    # When each is run as printed, the demo's processes all stopped
    with restarted_redis(cmds) as (export, commands):
        status, audit, export_cmd, dashboard = commands
        said = {}
        for name, line in (("status", status), ("audit", audit), ("export", export_cmd)):
            done = shell(export, line)
            # Then each exits 0
            assert done.returncode == 0, (line, done.stdout + done.stderr)
            said[name] = done.stdout
        assert f"finished: every sample has an outcome ({N} done, 0 failed" in said["status"]
        assert f"whole: {N} " in said["audit"], said["audit"]
        look_at_the_dashboard(export, dashboard, tmp_path)


def look_at_the_dashboard(export: str, line: str, tmp: Path) -> None:
    """Serve the printed dashboard line; the finished run shows nothing DOWN or LOST."""
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", line)[1])  # type: ignore[index]
    with serving(export, line, port) as snap:
        st = snap["status"]
        assert isinstance(st, dict) and st["finished"], st
        # Each host stopped after the finish, and its rate is the run's (one rule for both)
        [host] = st["hosts"]
        assert host["state"] == "stopped" and not host["alive"], host
        assert host["rate_per_s"] == pytest.approx(st["rate_per_s"], rel=1e-6), (host, st)
        dom = chromium(f"http://127.0.0.1:{port}/", tmp, "--dump-dom").stdout
        assert 'data-ready="1"' in dom, dom[-3000:]
        assert re.search(r'id="v-server">stopped<', dom), dom
        assert "stopped after the finish" in dom
        assert "DOWN" not in dom and "LOST" not in dom
        assert re.search(r'class="badge finished"', dom)
        assert re.search(r'id="disks-note" hidden="">', dom), dom  # both disks are here
    # And where the dump dir is not on its machine, its empty plot says why
    gone = tmp / "no-dump-dir"
    with serving(f"{export}\nexport FARM_DUMP_DIR={gone}", line, port):
        dom = chromium(f"http://127.0.0.1:{port}/", tmp, "--dump-dom").stdout
        assert (f"No dump dir free space: {gone} does not exist on this machine (the dashboard "
                "plots the disks of the host it runs on; FARM_DUMP_DIR names the directory)."
                in dom), dom


@contextmanager
def serving(export: str, line: str, port: int) -> Iterator[dict[str, Any]]:
    """The dashboard started by ``line``, until its first snapshot (yielded) and after."""
    proc = subprocess.Popen(["bash", "-c", f"{export}\nexec {line}"], cwd=ROOT,
                            env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        def snapshot() -> dict[str, Any] | None:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            with suppress(subprocess.SubprocessError):
                got = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{port}/api/run"],
                                     capture_output=True, text=True, timeout=10)
                if got.returncode == 0:
                    return dict(json.loads(got.stdout))
            return None

        wait_until(lambda: snapshot() is not None, 60, "the dashboard's first sample")
        snap = snapshot()
        assert snap is not None
        yield snap
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_fp8_demo_stores_fp8_and_audits_whole_without_a_setting(
        tmp_path: Path, tiny_model: Path, how: str) -> None:
    # When the demo is asked for fp8, by its flag or by FARM_STORE_DTYPE
    if how == "flag":
        res = run_demo(tmp_path, "--store-dtype", "fp8_e4m3")
    else:
        res = run_demo(tmp_path, FARM_STORE_DTYPE="fp8_e4m3")
    # Then the server and the workers stored fp8
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "storing fp8_e4m3" in res.stdout, res.stdout
    out = tmp_path / "demo" / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fingerprint"]["dtype"] == DTYPE_FP8
    files = sorted((out / "samples").rglob(f"*{DUMP_SUFFIX}"))
    assert len(files) == N
    assert {tensorfile.read_header(p).tensors[T_HIDDEN].dtype for p in files} == {"F8_E4M3"}
    # And its printed audit finds every file whole, FARM_STORE_DTYPE set nowhere
    cmds = look_commands(res.stdout)
    assert "FARM_STORE_DTYPE" not in "\n".join(cmds)
    with restarted_redis(cmds) as (export, commands):
        [audit] = [x for x in commands if " -m producer audit" in x]
        done = shell(export, audit)
        assert done.returncode == 0 and f"whole: {N} " in done.stdout, done.stdout + done.stderr
        if how == "flag":
            audit_with_another_model(export, audit, tiny_model, tmp_path)


def audit_with_another_model(export: str, audit: str, tiny_model: Path, tmp: Path) -> None:
    """Audit with a model whose config differs: every file incompatible, and the differing
    field named once."""
    other = tmp / "other-model"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "note": "another model"}))
    done = shell(f"{export}\nexport FARM_MODEL_PATH={other}", audit)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"incompatible: {N}\n" in done.stdout, done.stdout
    assert done.stdout.count("config_sha256: ") == 1, done.stdout
    assert "this audit's model differs from the run's (this audit != the run's manifest): " \
           "config_sha256: " in done.stdout, done.stdout
    assert "dtype" not in done.stdout.split("incompatible:")[1].split("\n")[1], done.stdout
