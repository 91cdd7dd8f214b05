"""``status`` on a real Redis: stale entries cleaned, pauses and retries explained, no server.

The farm's own run (workers, failures, the finished line) is checked in test_dashboard.py;
here the index is written as workers write it, so each case is exact and takes a second.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from producer.localfarm.farm import LocalFarm, free_port
from tests.conftest import CACHE
from worker.core import liveness, outdir
from worker.core.store import OutputStore
from worker.server.fingerprint import compute_fingerprint
from worker.state import keys
from worker.state.index import Registered, RunIndex
from worker.state.lease import lease_name


def _gone_identity() -> str:
    """The identity of a process of this host that has exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return f"{liveness.HOST}:{proc.pid}:1:{liveness.MACHINE}"


def test_status_without_server_cleans_stale_entries_and_explains(tmp_path: Path,
                                                                 tiny_model: Path) -> None:
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE)  # Redis only: no server, no workers
    try:
        farm.start_redis()
        fp = compute_fingerprint(farm.settings(), tiny_model)
        # the manifest, as the first worker writes it: it names the run
        run = OutputStore(farm.output_dir, fp).open().run_id
        r, dead, me = farm.redis(), _gone_identity(), liveness.identity()
        index = RunIndex(r, run)
        index.register({k: Registered(1, i * 10, 10, "0" * 64, i) for i, k in enumerate("abcd")})
        # Given three samples marked running: "a" whose attempt ended without a trace (its
        # lease is free), "b" whose lease holder exited, "c" held by a live process
        r.set(lease_name(run, "b"), f"{dead}#t1")
        r.set(lease_name(run, "c"), f"{me}#t2")
        for key in ("a", "b", "c"):
            index.mark_running(key, f"{liveness.HOST}:1", 1)
        # and a live process paused for low disk, a gone one paused for the server
        index.set_paused(me, "output disk /nvme/out low: 1.0 MB free, waiting for 2.0 MB")
        index.set_paused(dead, "server http://x does not answer")
        index.mark_retrying("d", 2, "Corrupt: dump hsd-d-a2-n9.safetensors: 1 NaN/Inf values")
        # When status runs with the server down and no FARM_MODEL_PATH
        res = farm.cli("status")
        # Then it reads the run from the manifest and explains what is going on
        assert res.returncode == 0, res.stdout + res.stderr
        out = res.stdout
        assert f"run {run} (from {farm.output_dir}/manifest.json)" in out
        assert "running 1, retrying 1 (2 stale running entries removed)" in out, out
        assert "paused    1 process: output disk /nvme/out low: 1.0 MB free" in out
        assert "does not answer" not in out
        assert "retrying: 1 (last error of each; newest first)\n  d after attempt 2: Corrupt: " \
               "dump hsd-d-a2-n9.safetensors: 1 NaN/Inf values" in out
        assert "progress  0/4 done (0.0%), failed 0, rejected 0, remaining 4" in out
        assert "ETA - (paused, see below)" in out and "finished" not in out
        assert set(index.outcomes(keys.RUNNING)) == {"c"}
        assert set(index.outcomes(keys.PAUSED)) == {me}
        # And --json (with --failures) is one JSON document and nothing else
        res = farm.cli("status", "--json", "--failures")
        body = json.loads(res.stdout)
        assert body["running"] == 1 and body["fingerprint_from"].endswith("manifest.json")
        assert [(f["kind"], f["key"]) for f in body["failures"]] == [("retrying", "d")]
        assert list(body["paused"]) == [me]
    finally:
        farm.close(kill=True)


def test_status_without_manifest_or_server_says_what_to_do(tmp_path: Path) -> None:
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE)
    farm.output_dir.mkdir()
    # Given a server address that takes connections and never answers (a wait for it would
    # last its whole timeout; a connection is seen here)
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0)
        env = {"FARM_SERVER_URL": f"http://127.0.0.1:{server.getsockname()[1]}"}
        # When status and audit are pointed at an output dir that holds no run
        for cmd in ("status", "audit"):
            res = farm.cli(cmd, env=env)
            # Then each says so first, with the fix, and exits 2, without asking the server
            assert res.returncode == 2, res.stdout + res.stderr
            assert res.stderr.startswith(f"error: no run in {farm.output_dir}: it has no "
                                         "manifest.json"), res.stderr
            assert "Set FARM_OUTPUT_DIR to the run's output dir" in res.stderr
            assert "Traceback" not in res.stderr
            with pytest.raises(BlockingIOError):  # no connection waits to be taken
                server.accept()
    # And the dashboard, which may start before its run, says it first too
    res = farm.cli("dashboard", "--no-auth", "--port", str(free_port()))
    assert res.returncode == 2
    assert res.stderr.startswith(f"note: no run in {farm.output_dir}"), res.stderr
    assert "start it first or set FARM_MODEL_PATH" in res.stderr


def test_check_fails_while_samples_are_rejected_for_the_environment(tmp_path: Path,
                                                                    tiny_model: Path) -> None:
    from tests.conftest import write_samples

    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE,
                     extra_env={"FARM_MODEL_PATH": str(tiny_model)})  # Redis only, no server
    try:
        farm.start_redis()
        data = tmp_path / "data.json"
        ids = [str(s["id"]) for s in write_samples(data, 3)]
        assert farm.cli("enqueue", str(data), "--no-progress").returncode == 0
        r, index = farm.redis(), RunIndex(farm.redis(), farm.run_id())
        r.delete(farm.queue())  # as if a worker had taken every message
        sha = {k: reg.sha256 for k, reg in index.all_registered().items()}
        # Given a run an older version finished: one sample rejected for a gateway's 429,
        # two for their content (SGLang's own 400, over FARM_MAX_TOKENS)
        index.mark_rejected(ids[0], "server rejected /generate (429): <html>\r\n<head><title>"
                                    "429 Too Many Requests</title></head>", sha=sha[ids[0]])
        index.mark_rejected(ids[1], "server rejected the sample (400): The input_ids 99999 is "
                                    "out of vocabulary range [0, 1000).", sha=sha[ids[1]])
        index.mark_rejected(ids[2], "sample has 9000 tokens, over the maximum of 8192",
                            sha=sha[ids[2]])
        # When status --check runs
        res = farm.cli("status", "--check")
        # Then it does not call that run a success, and says what to do
        assert res.returncode == 1, res.stdout + res.stderr
        assert "1 samples are marked rejected for an answer of the server or a gateway" in (
            res.stderr)
        # and enqueue publishes that one again (and only that one)
        res = farm.cli("enqueue", str(data), "--no-progress")
        assert "published: 1\n" in res.stdout, res.stdout
        assert ids[0] not in index.outcomes(keys.REJECTED)
    finally:
        farm.close(kill=True)


def test_an_outcome_that_reaches_redis_after_done_leaves_the_run_finished(
        tmp_path: Path, tiny_model: Path) -> None:
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE)  # Redis only: no server, no workers
    try:
        farm.start_redis()
        fp = compute_fingerprint(farm.settings(), tiny_model)
        run = OutputStore(farm.output_dir, fp).open().run_id
        index = RunIndex(farm.redis(), run)
        index.register({k: Registered(1, i * 10, 10, "0" * 64, i) for i, k in enumerate("ab")})
        index.mark_started()
        # Given both samples done (their files verified, by this attempt or another; status
        # only sees that each file is there)
        for key in "ab":
            index.mark_done(key, 100, 10)
            final = outdir.final_path(farm.output_dir, key)
            final.parent.mkdir(parents=True, exist_ok=True)
            final.write_bytes(b"x" * 100)
        # When outcomes of attempts reach Redis after that, in the order a worker cut off
        # from Redis sends them once it answers again: "a" failed an attempt (its mark_done
        # timed out), "b" failed its last one
        index.mark_retrying("a", 1, "Transient: redis: TimeoutError: Timeout reading from socket")
        index.mark_failed("b", "Transient: redis: TimeoutError", 5)
        index.mark_stale("b", "the record changed")
        # Then neither is recorded: the run is finished, and status says so
        assert index.outcomes(keys.RETRYING) == {} and index.outcomes(keys.FAILED) == {}
        assert index.outcomes(keys.STALE) == {}
        res = farm.cli("status")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "progress  2/2 done (100.0%), failed 0, rejected 0, remaining 0" in res.stdout
        assert "running 0, retrying 0" in res.stdout and "finished: " in res.stdout
        # And a sample not done still records its outcomes
        index.register({"c": Registered(1, 20, 10, "0" * 64, 2)})
        index.mark_retrying("c", 1, "Corrupt: x")
        assert set(index.outcomes(keys.RETRYING)) == {"c"}
    finally:
        farm.close(kill=True)
