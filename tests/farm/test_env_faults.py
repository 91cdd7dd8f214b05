"""Faults of the environment never count against a sample: a gateway that refuses requests for
a while, an output disk that turns read-only, a server whose context is shorter than
``FARM_MAX_TOKENS``. Real Redis, real workers, the real reference server, a real HTTP proxy
and real mounts."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import assert_farm_invariants, wait_finished
from tests.support.faults import (
    NGINX_413,
    NGINX_429,
    NGINX_502,
    RESET,
    Gateway,
    attempts,
    can_mount_tmpfs,
    enqueue,
    failed,
    read_only,
    run_hash,
    running_farm,
    settled,
    small_tmpfs,
)
from worker.core import tensorfile
from worker.core.finalfile import M_TRUNCATED
from worker.state import keys as keys_mod


def rejected(farm: LocalFarm) -> dict[str, str]:
    return {k: json.loads(v)["reason"] for k, v in run_hash(farm, keys_mod.REJECTED).items()}


def done(farm: LocalFarm) -> int:
    return len(run_hash(farm, keys_mod.BYTES))


@pytest.fixture
def mountable(tmp_path: Path) -> None:
    if not can_mount_tmpfs(tmp_path):
        pytest.skip("this machine does not let the test mount a tmpfs (needs root)")


@pytest.fixture
def gateway_farm(tmp_path: Path, tiny_model: Path) -> Iterator[tuple[LocalFarm, Gateway]]:
    with running_farm(tmp_path, ["--forward-delay-s", "0.2"], chunk=512) as farm:
        gw = Gateway(f"http://127.0.0.1:{farm.server_port}")
        farm.extra_env["FARM_SERVER_URL"] = gw.url
        try:
            yield farm, gw
        finally:
            gw.close()


def test_gateway_refusals_spend_no_attempts(tmp_path: Path,
                                            gateway_farm: tuple[LocalFarm, Gateway]) -> None:
    # Given a worker that reaches the server through a gateway (nginx in front of it), and
    # two attempts per sample
    farm, gw = gateway_farm
    farm.extra_env["FARM_MAX_ATTEMPTS"] = "2"
    farm.start_worker("w1", concurrency=2)
    keys = enqueue(farm, tmp_path, 40)
    wait_until(lambda: done(farm) >= 2, 60, "the first samples")
    # When the gateway answers 429 (its rate limiter), then 413 with its HTML error page,
    # each for 3 s, instead of the server, then resets the connections of /generate requests
    # (the server stays healthy), then answers 502 (the server behind it restarting)
    for status, page in ((429, NGINX_429), (413, NGINX_413), (RESET, ""), (502, NGINX_502)):
        if status == RESET:
            gw.reset(only="/generate")
        else:
            gw.refuse(status, page)
        time.sleep(3)
    gw.forward()
    # Then the requests it refused were the environment's: nothing rejected or failed, no
    # attempt spent, every sample done, and status --check says so
    wait_finished(farm, 40, timeout_s=180)
    assert gw.refused > 0
    assert not rejected(farm), f"{len(rejected(farm))} rejected: {rejected(farm)}"
    assert_farm_invariants(farm, keys)
    assert set(attempts(farm).values()) == {1}, attempts(farm)
    log = farm.procs["w1"].log.read_text()
    assert "paused (no attempt spent): ServerBusy: server answered /generate with 429" in log
    assert "the server itself is healthy: the network or a gateway" in log
    res = farm.cli("status", "--check")
    assert res.returncode == 0, res.stdout + res.stderr


def test_read_only_output_disk_pauses_then_resumes(tmp_path: Path, tiny_model: Path,
                                                   mountable: None) -> None:
    # Given an output disk (a tmpfs) and two attempts per sample
    out = tmp_path / "farm" / "out"
    env = {"FARM_MAX_ATTEMPTS": "2"}
    with small_tmpfs(out, "200M"), running_farm(tmp_path, ["--forward-delay-s", "0.2"],
                                                env=env, chunk=512) as farm:
        farm.start_worker("w1", concurrency=2)
        keys = enqueue(farm, tmp_path, 30)
        wait_until(lambda: done(farm) >= 2, 60, "the first samples")
        # When the file system turns read-only for 6 s (ext4 errors=remount-ro, an NFS flip)
        with read_only(out):
            time.sleep(6)
            assert not failed(farm), failed(farm)
        # Then the writes that hit it paused without spending an attempt, and once it is
        # writable again the run finishes by itself
        wait_finished(farm, 30, timeout_s=180)
        assert set(attempts(farm).values()) == {1}, attempts(farm)
        assert_farm_invariants(farm, keys)
        log = farm.procs["w1"].log.read_text()
        assert "paused (no attempt spent): OutputUnavailable" in log


def test_read_only_output_dir_at_start_exits_2(tmp_path: Path, tiny_model: Path,
                                               mountable: None) -> None:
    # Given an output dir on a file system that is read-only when the worker starts
    out = tmp_path / "farm" / "out"
    with small_tmpfs(out, "20M"), running_farm(tmp_path) as farm, read_only(out):
        # When a worker starts
        proc = farm.start_worker("w1", concurrency=1, wait=False)
        wait_until(lambda: not proc.alive(), 90, "the worker to exit")
        # Then it exits with code 2 (systemd does not restart it) and says what to fix
        assert proc.popen is not None and proc.popen.returncode == 2, proc.log.read_text()[-3000:]
        assert "cannot be written" in proc.log.read_text()


def test_server_context_shorter_than_max_tokens(tmp_path: Path, tiny_model: Path) -> None:
    # Given a server whose context is 160 tokens, under FARM_MAX_TOKENS (8192 by default)
    with running_farm(tmp_path, ["--context-length", "160"]) as farm:
        # When a worker starts with FARM_OVERLONG=reject
        proc = farm.start_worker("w1", concurrency=1, wait=False)
        wait_until(lambda: not proc.alive(), 90, "the worker to exit")
        # Then it refuses before it consumes anything, with the fix
        log = proc.log.read_text()
        assert proc.popen is not None and proc.popen.returncode == 2, log[-3000:]
        assert "FARM_MAX_TOKENS" in log and "--context-length" in log
        # When one starts with FARM_OVERLONG=truncate (a run of its own: another fingerprint)
        farm.extra_env["FARM_OVERLONG"] = "truncate"
        farm.start_worker("w2", concurrency=2)
        # (samples whose first assistant token lies within what the server takes)
        keys = enqueue(farm, tmp_path, 5, start=6) + enqueue(farm, tmp_path, 4, start=12)
        wait_finished(farm, 9, timeout_s=180)
        # Then the samples longer than the server takes are cut to what it takes, none is
        # rejected, and audit finds every file whole
        assert not rejected(farm), rejected(farm)
        assert_farm_invariants(farm, keys)
        lengths = {}
        for p in (farm.output_dir / "samples").rglob("*.safetensors"):
            header = tensorfile.read_header(p)
            lengths[p.name] = (int(header.tensors["input_ids"].shape[0]),
                               int(header.metadata[M_TRUNCATED]))
        assert max(n for n, _ in lengths.values()) <= 160 - 7, lengths
        assert any(cut > 160 for _, cut in lengths.values()), lengths


def test_a_dump_dir_deleted_mid_run_pauses_then_resumes(tmp_path: Path,
                                                        tiny_model: Path) -> None:
    # Given a run under way
    with running_farm(tmp_path, ["--forward-delay-s", "0.2"], chunk=512) as farm:
        w = farm.start_worker("w1", concurrency=2)
        keys = enqueue(farm, tmp_path, 30)
        wait_until(lambda: done(farm) >= 2, 60, "the first samples")
        # When the dump dir is deleted (someone cleans /dev/shm) for 12 s
        mark = len(w.log.read_bytes())
        shutil.rmtree(farm.dump_dir)
        time.sleep(12)
        window = w.log.read_bytes()[mark:].decode(errors="replace")
        status = farm.cli("status")
        # Then the worker pauses: no busy loop of deliveries handed back, no attempt spent,
        # nothing failed, and status says why with the fix
        received = window.count(" received")
        handed_back = window.count("handing the message back")
        print(f"dump dir gone 12 s: {received} deliveries, {handed_back} handed back")
        assert received <= 4 and handed_back <= 2, (received, handed_back, window[-3000:])
        assert not failed(farm), failed(farm)
        assert f"dump dir {farm.dump_dir} is gone" in status.stdout, status.stdout
        assert f"mkdir -m 0700 {farm.dump_dir}" in status.stdout
        # And once the dir is made again (no ready marker: the server is not restarted), the
        # run finishes by itself
        os.mkdir(farm.dump_dir, 0o700)
        wait_finished(farm, 30, timeout_s=180)
        assert set(attempts(farm).values()) == {1}, attempts(farm)
        assert_farm_invariants(farm, keys)
        res = farm.cli("status", "--check")
        assert res.returncode == 0, res.stdout + res.stderr


# A process standing in for a server's hook whose dump writer is unhealthy: its note, then it
# lives on (argv: dump dir, seconds)
UNHEALTHY = ("import sys, time; from pathlib import Path; "
             "from engine_dump.markers import write_unhealthy; "
             "write_unhealthy(Path(sys.argv[1]), 'behind: its queue stayed full for 30s'); "
             "print('noted', flush=True); time.sleep(float(sys.argv[2]))")


def test_an_unhealthy_dump_writer_pauses_the_workers_then_they_resume(
        tmp_path: Path, tiny_model: Path) -> None:
    import signal
    import subprocess
    import sys

    # Given a run under way
    with running_farm(tmp_path, ["--forward-delay-s", "0.2"], chunk=512) as farm:
        farm.start_worker("w1", concurrency=2)
        keys = enqueue(farm, tmp_path, 16)
        wait_until(lambda: done(farm) >= 2, 60, "the first samples")
        # When a live process of the server says its dump writer is unhealthy (stood in: the
        # reference server's writer cannot be made to stall from outside)
        note = subprocess.Popen([sys.executable, "-c", UNHEALTHY, str(farm.dump_dir), "600"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert note.stdout is not None and note.stdout.readline() == "noted\n"
            wait_until(lambda: "dump writer is unhealthy" in farm.cli("status").stdout, 60,
                       "status to show the pause")
            # (a request sent before a process saw the note ends on its own: a clean-clone run
            # saw one finish after status showed the pause)
            before = settled(lambda: done(farm), quiet_s=10, timeout_s=120)
            time.sleep(8)
            status = farm.cli("status").stdout
            # Then the workers pause, naming the writer and why, send nothing, fail nothing
            assert f"the server's dump writer is unhealthy (pid {note.pid} on " in status, status
            assert "behind: its queue stayed full for 30s" in status
            assert done(farm) == before and not failed(farm), failed(farm)
        finally:
            os.killpg(note.pid, signal.SIGKILL)  # pass or fail
            note.wait(10)
        # And once that process is gone (its note no longer counts) the run finishes by itself,
        # each sample in one attempt
        wait_finished(farm, 16, timeout_s=180)
        assert set(attempts(farm).values()) == {1}, attempts(farm)
        # (its dead note goes at the next start of a hook in that dump dir, as here)
        from engine_dump.dump_writer import remove_stale_files

        assert remove_stale_files(farm.dump_dir) == 1
        assert_farm_invariants(farm, keys)
