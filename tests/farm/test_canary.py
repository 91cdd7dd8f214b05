"""The canary: recorded once per run, re-checked by every worker; a server serving other
weights pauses the farm with nothing lost, and the same model (restarted, chunked or not)
passes. Real Redis, real ``celery worker`` processes, real reference servers."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from producer.localfarm.farm import LocalFarm, wait_until
from sglang_patch.tiny_model import ensure_tiny_model
from tests.conftest import CACHE, assert_farm_invariants, wait_finished
from tests.support.checkpoints import bos_row_changed
from tests.support.faults import (
    FlakyProxy,
    attempts,
    enqueue,
    failed,
    kill,
    run_hash,
    running_farm,
    text,
)
from worker.core import canary as cn
from worker.core import liveness, outdir, tensorfile
from worker.server.canary_check import CanaryCheck, Outcome
from worker.server.client import ServerClient
from worker.server.fingerprint import compute_fingerprint
from worker.state import keys
from worker.state.index import RunIndex
from worker.state.queue_scan import broker_depth


@pytest.fixture(scope="module")
def other_model() -> Path:
    """Same config and tokenizer as the tiny model, other weights (a 'fine-tune')."""
    return ensure_tiny_model(CACHE, seed=1)


def _swap_server(farm: LocalFarm, model: Path | None, chunk: int) -> None:
    """Stop the server; start it again (same port and dump dir) on ``model``, or the tiny one."""
    farm.procs["server"].stop()
    farm.chunked_prefill_size = chunk
    farm.start_server(["--model", str(model)] if model else None)


def _paused(farm: LocalFarm) -> list[str]:
    return [json.loads(v)["reason"] for v in run_hash(farm, keys.PAUSED).values()]


# --- the recording and the comparison, without services --------------------------------------


def test_processes_of_a_host_share_the_verdict(tmp_path: Path, tiny_model: Path) -> None:
    """Through Redis: a pass holds for an interval, a mismatch makes every process check, and
    one process checks at a time. The server here answers its liveness probe and fails every
    other request (a check that is made fails); with no server, the server is the reason."""
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE)
    server = _LivenessOnly()
    try:
        farm.start_redis()
        settings = dataclasses.replace(farm.settings(), canary_interval_s=0.5,
                                       server_url=server.url)
        settings.dump_dir.mkdir(parents=True)
        check = CanaryCheck(settings, settings.output_dir, tiny_model,
                            compute_fingerprint(settings, tiny_model), "w", encode=lambda t: [])
        r, loop = farm.redis(), asyncio.new_event_loop()
        client = ServerClient(settings.server_url, 5)
        index = RunIndex(r, check.run_id)
        shared = check.verdicts(index)
        verdict, lock = shared.key, shared.lock_key
        # Given no verdict yet: the process checks (and here cannot reach the server)
        assert "could not be checked" in str(check.problem(client, loop, index))
        assert r.get(lock) is None  # the lock is given back
        # Given another process of the host passed: this one takes its verdict, and is not
        # due again before the interval
        r.set(verdict, "ok")
        assert check.problem(client, loop, index) is None and not check.due()
        r.delete(verdict)
        assert check.problem(client, loop, index) is None  # not due: nothing asked
        time.sleep(0.6)
        assert check.due()
        # Given another process is checking now: this one waits for its verdict
        r.set(lock, "someone")
        assert "being checked by another process" in str(check.problem(client, loop, index))
        # Given another process saw a mismatch: this one checks at once, due or not
        r.delete(lock)
        r.set(verdict, "ok")
        check.problem(client, loop, index)
        assert not check.due()
        r.set(verdict, "mismatch")
        assert "could not be checked" in str(check.problem(client, loop, index))
        # Given a pass shared before this process saw the server down: it checks itself (the
        # server may be back with another model and the same ready markers)
        r.set(verdict, f"ok:{time.time()}")
        assert check.problem(client, loop, index) is None
        check.force()
        assert "could not be checked" in str(check.problem(client, loop, index))
        # ...but a pass shared after that moment holds
        r.set(verdict, f"ok:{time.time()}")
        assert check.problem(client, loop, index) is None
        # Given the server gone while a check is due: its silence is the reason (the words of a
        # wait on the server, which status reads), and no process holds the lock to find out
        server.close()
        check.force()
        assert check.problem(client, loop, index) == (f"server {server.url} does not answer "
                                                  "(restarting, loading the model, or hung)")
        assert r.get(lock) is None
        loop.run_until_complete(client.close())
        loop.close()
    finally:
        server.close()
        farm.close(kill=True)


class _LivenessOnly:
    """An HTTP server that answers SGLang's liveness probe (``/model_info``) and fails every
    other request with a 503: a server up whose canary cannot be checked."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/model_info":
                    self._send(200, b'{"model_path": "tiny"}')
                else:
                    self._send(503, b'{"error": "down for the test"}')

            do_POST = do_GET

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()


class _Mismatching(CanaryCheck):
    """A check whose server computes other states (the seam: what ``run`` finds)."""

    async def run(self, client: ServerClient) -> Outcome:
        return Outcome(False, "CANARY MISMATCH: ...", "canary mismatch: worst final: max rel "
                       "err 166%: restore the server's model, or start a new FARM_OUTPUT_DIR")


def _gone_identity() -> str:
    """The identity an exited process of this machine had."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c",
                             "from worker.core import liveness; print(liveness.identity())"],
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    return out.strip()


def test_a_mismatch_shows_as_the_mismatch_and_a_dead_checkers_lock_is_taken_over(
        tmp_path: Path, tiny_model: Path) -> None:
    """Real Redis, a server that answers only its liveness probe: the check's outcome is the
    seam."""
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE)
    server = _LivenessOnly()
    try:
        farm.start_redis()
        settings = dataclasses.replace(farm.settings(), server_url=server.url)
        settings.dump_dir.mkdir(parents=True)
        fp = compute_fingerprint(settings, tiny_model)
        first = _Mismatching(settings, settings.output_dir, tiny_model, fp, "w", lambda t: [])
        other = CanaryCheck(settings, settings.output_dir, tiny_model, fp, "w", lambda t: [])
        r, loop = farm.redis(), asyncio.new_event_loop()
        client = ServerClient(settings.server_url, 5)
        index = RunIndex(r, first.run_id)
        lock = first.verdicts(index).lock_key
        # Given a process of the host that found the server computing other states
        assert "canary mismatch" in str(first.problem(client, loop, index))
        # When another process checks again now (the lock held by a live process)
        r.set(lock, f"{liveness.identity()}#checking")
        why = str(other.problem(client, loop, index))
        # Then the others' pause says the mismatch and its fix, not that someone checks
        assert "canary mismatch" in why and "restore the server's model" in why, why
        # Given the process checking the canary died holding the lock
        r.set(lock, f"{_gone_identity()}#checking")
        # Then the next process takes the lock over at once and checks (here: in vain)
        assert "could not be checked" in str(other.problem(client, loop, index))
        assert r.get(lock) is None
        # And a lock whose holder cannot be judged from here (of another machine with our
        # hostname, or an older worker's, which does not say where it ran) is left to expire
        for holder in (f"{liveness.HOST}:1:1:0123456789abcdef-1#checking",
                       f"{liveness.HOST}:1:1"):
            r.set(lock, holder, px=1500)
            assert "canary mismatch" in str(other.problem(client, loop, index))
            time.sleep(1.6)
            assert "could not be checked" in str(other.problem(client, loop, index))
        loop.run_until_complete(client.close())
        loop.close()
    finally:
        server.close()
        farm.close(kill=True)


# --- the farm --------------------------------------------------------------------------------

def test_server_on_other_weights_pauses_the_farm_and_loses_nothing(
        tmp_path: Path, tiny_model: Path, other_model: Path) -> None:
    with running_farm(tmp_path, chunk=256) as farm:
        # Given a run whose first worker recorded the canary (chunked prefill, 256)
        w1 = farm.start_worker("w1", concurrency=2)
        first = enqueue(farm, tmp_path, 3)
        wait_finished(farm, 3)
        assert "recorded the run's canary: 3 prompts" in w1.log.read_text()
        assert cn.path_in(farm.output_dir).exists()
        # When the server restarts on other weights of the same config (w1 keeps its model
        # dir, which still holds the recorded files), and more samples are queued
        _swap_server(farm, other_model, chunk=256)
        more = enqueue(farm, tmp_path, 6, start=3)
        # Then w1's tasks hold their messages and wait, printing per layer what differs
        wait_until(lambda: "CANARY MISMATCH" in w1.log.read_text(), 90, "w1 to see it")
        log = w1.log.read_text()
        assert "max rel err" in log and "aux layer 2" in log and "final" in log
        assert "restore the server's model" in log and "new output directory" in log
        # and a worker starting now refuses the server: it says it serves other weights
        farm.extra_env["FARM_MODEL_PATH"] = str(tiny_model)
        w2 = farm.start_worker("w2", concurrency=1, wait=False)
        wait_until(lambda: not w2.alive(), 90, "w2 to refuse the server")
        log = w2.log.read_text()
        assert w2.popen is not None and w2.popen.returncode == 2, log[-2000:]
        assert "but the run's weights are" in log and " ready." not in log
        reasons = _paused(farm)
        # (every paused process says the mismatch: also those waiting while one re-checks)
        assert reasons and all("canary mismatch" in r for r in reasons), reasons
        assert not any(outdir.final_path(farm.output_dir, k).exists() for k in more)
        assert not failed(farm)
        waiting, unacked = broker_depth(farm.redis(), farm.queue())
        assert waiting + unacked == 6
        # When the run's model is served again (restarted, now unchunked)
        _swap_server(farm, None, chunk=-1)
        # Then w1 passes the canary, a new worker starts, and they finish the run, nothing failed
        w2 = farm.start_worker("w2", concurrency=1)
        wait_finished(farm, 9)
        assert "canary passed" in w2.log.read_text()
        assert_farm_invariants(farm, first + more)
        assert not _paused(farm)


def test_a_change_to_the_bos_embedding_row_pauses_the_farm(
        tmp_path: Path, tiny_model: Path) -> None:
    changed = bos_row_changed(tiny_model, tmp_path / "bos")
    with running_farm(tmp_path) as farm:
        # Given a run whose worker recorded the canary
        w1 = farm.start_worker("w1", concurrency=1)
        first = enqueue(farm, tmp_path, 2)
        wait_finished(farm, 2)
        assert "recorded the run's canary" in w1.log.read_text()
        # When the server restarts on a copy of the checkpoint whose only change is the BOS
        # token's embedding row, which every sample's first token reads, and more are queued
        _swap_server(farm, changed, chunk=64)
        more = enqueue(farm, tmp_path, 3, start=2)
        # Then the running worker's canary sees it in every layer, and it takes no work
        wait_until(lambda: "CANARY MISMATCH" in w1.log.read_text(), 120, "w1 to see it")
        log = w1.log.read_text()
        table = log[log.index("CANARY MISMATCH"):]
        assert "final" in table and "<-- differs" in table, table[:3000]
        print(table[: table.index("This worker takes no work")])
        assert not any(outdir.final_path(farm.output_dir, k).exists() for k in more)
        assert not failed(farm)
        waiting, unacked = broker_depth(farm.redis(), farm.queue())
        assert waiting + unacked == 3
        # And once the run's checkpoint is served again, the run finishes
        _swap_server(farm, None, chunk=64)
        wait_finished(farm, 5)
        assert_farm_invariants(farm, first + more)


def test_a_recording_of_plain_text_prompts_is_still_compared(tmp_path: Path,
                                                             tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    with running_farm(tmp_path) as farm:
        # Given a run whose canary an older hsfarm recorded: the prompts' text alone, encoded
        # without special tokens, and no prompts_form in its metadata
        settings = farm.settings()
        old = CanaryCheck(settings, settings.output_dir, tiny_model,
                          compute_fingerprint(settings, tiny_model), "w",
                          encode=lambda m: tok(m[1]["content"], add_special_tokens=False)
                          ["input_ids"])
        settings.output_dir.mkdir(parents=True, exist_ok=True)
        client = ServerClient(settings.server_url, 30)
        loop = asyncio.new_event_loop()
        try:
            assert loop.run_until_complete(old.run(client)).passed
            loop.run_until_complete(client.close())
        finally:
            loop.close()
        path = cn.path_in(farm.output_dir)
        tf = tensorfile.read(path)
        meta = {k: v for k, v in tf.metadata.items() if k != cn.M_PROMPTS}
        tensorfile.write(path, tf.tensors, meta)
        recorded, _ = cn.load(farm.output_dir)
        assert recorded[0].input_ids[0] != tok.bos_token_id
        # When a worker of this hsfarm starts on the run
        w = farm.start_worker("w", concurrency=1)
        keys_ = enqueue(farm, tmp_path, 2)
        wait_finished(farm, 2)
        # Then it compared the old recording, passed, and says what it cannot see
        log = w.log.read_text()
        assert "canary passed" in log and "recorded by an older hsfarm from plain text" in log
        assert_farm_invariants(farm, keys_)


def test_other_checkpoint_is_refused_by_its_identity_before_any_request(
        tmp_path: Path, tiny_model: Path, other_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        # Given a finished run, whose worker asks the server which model it serves
        w1 = farm.start_worker("w1", concurrency=2)
        keys_ = enqueue(farm, tmp_path, 3)
        wait_finished(farm, 3)
        w1.stop()
        # When the server restarts on another checkpoint of the same config and a worker starts
        _swap_server(farm, other_model, chunk=64)
        more = enqueue(farm, tmp_path, 4, start=3)
        bad = farm.start_worker("bad", concurrency=1, wait=False)
        wait_until(lambda: not bad.alive(), 120, "the worker to exit")
        # Then it exits with code 2 naming the shard and the fix, having sent no request
        assert bad.popen is not None and bad.popen.returncode == 2
        log = bad.log.read_text()
        assert "weights identity" in log and "sampled bytes differ" in log, log[-2000:]
        assert "Restore the original checkpoint" in log
        info = json.loads(urllib.request.urlopen(
            farm.env()["FARM_SERVER_URL"] + "/server_info", timeout=10).read())
        assert info["forward_passes"] == 0  # not even the hook probe ran
        assert broker_depth(farm.redis(), farm.queue()) == (4, 0)
        # And audit calls a file written under another identity incompatible
        path = outdir.final_path(farm.output_dir, keys_[0])
        tf = tensorfile.read(path)
        tensorfile.write(path, tf.tensors, {**tf.metadata, "weights_id": "0123456789abcdef"})
        res = farm.cli("audit", "--data", str(tmp_path / "data.json"))
        assert res.returncode == 1 and "incompatible: 1\n" in res.stdout, res.stdout
        assert f"incompatible {keys_[0]}: written under weights identity 0123456789abcdef" \
            in res.stdout
        # And with the original checkpoint served again, the run goes on
        _swap_server(farm, None, chunk=64)
        farm.start_worker("w2", concurrency=2)
        wait_finished(farm, 7)
        assert sorted(p.name for p in (farm.output_dir / "samples").rglob("*.safetensors")) \
            == sorted(f"{k}.safetensors" for k in keys_ + more)
        # And audit --requeue has the file of the other identity extracted again, in place
        data = str(tmp_path / "data.json")
        assert farm.cli("audit", "--data", data, "--requeue").returncode == 1
        wait_until(lambda: farm.cli("audit", "--data", data).returncode == 0, 90,
                   "audit to find every file whole")
        assert tensorfile.header_metadata(path)["weights_id"] != "0123456789abcdef"


def test_a_flaky_server_slows_the_farm_but_never_stops_it(tmp_path: Path) -> None:
    """Of every four requests, one is answered 500 and one never dumps (``FlakyProxy``).
    (A sample's attempts here are spent on the same faults: the limit is raised so that the
    check under test is the canary's.)"""
    env = {"FARM_DUMP_TIMEOUT_S": "3", "FARM_MAX_ATTEMPTS": "10"}
    with running_farm(tmp_path, env=env) as farm, \
            FlakyProxy(farm.env()["FARM_SERVER_URL"]) as proxy:
        farm.extra_env["FARM_SERVER_URL"] = proxy.url
        # Given a worker starting behind the flaky server: it records the run's canary
        w1 = farm.start_worker("w1", concurrency=1, wait=False)
        wait_until(lambda: " ready." in w1.log.read_text(), 60, "w1 to start consuming")
        # When samples are queued, and a second worker starts: it compares with the recording
        first = enqueue(farm, tmp_path, 4)
        w2 = farm.start_worker("w2", concurrency=1, wait=False)
        wait_until(lambda: " ready." in w2.log.read_text(), 60, "w2 to start consuming")
        wait_finished(farm, 4, timeout_s=120)
        # Then both passed the canary through the faults, and every sample is done
        assert proxy.failed["500"] and proxy.failed["no dump"], proxy.failed
        assert "recorded the run's canary" in w1.log.read_text()
        assert "canary passed" in w2.log.read_text()
        assert_farm_invariants(farm, first)
        # And no HTTP session was left unclosed on any path
        for w in (w1, w2):
            log = w.log.read_text()
            assert "Unclosed client session" not in log and "ResourceWarning" not in log, \
                log[-3000:]


def test_a_canary_checker_killed_holding_the_lock_stalls_its_host_seconds_not_minutes(
        tmp_path: Path) -> None:
    # Given a worker whose processes re-check the canary every second
    with running_farm(tmp_path, env={"FARM_CANARY_INTERVAL_S": "1"}) as farm:
        w1 = farm.start_worker("w1", concurrency=3)
        r = farm.redis()
        samples = enqueue(farm, tmp_path, 12)
        # When a pool process is SIGKILLed right after taking the host's canary lock
        pids: list[int] = []

        def locked() -> bool:
            for k in r.scan_iter(f"{keys.PREFIX}:*:{keys.CANARY_LOCK}:*"):
                holder = r.get(k)
                if holder is not None:
                    pids.append(int(text(holder).split("#")[0].split(":")[1]))
                    return True
            return False

        # (a host that finishes its samples while a shared pass holds never needs the lock:
        # more work then, until a check takes it)
        deadline = time.monotonic() + 60
        while True:
            try:
                wait_until(locked, 5, "a process to take the canary lock", poll_s=0.002)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
                samples += enqueue(farm, tmp_path, 12, start=len(samples))
        kill(pids[0])
        killed_at = time.monotonic()
        assert pids[0] in w1.children()
        # (more work once the next re-check is due, so the lock is needed again even when the
        # first 12 finish within the interval)
        time.sleep(1.5)
        samples += enqueue(farm, tmp_path, 12, start=len(samples))
        # Then the host works again within seconds: every sample done, none failed
        wait_finished(farm, len(samples), timeout_s=40)
        took_s = time.monotonic() - killed_at
        assert_farm_invariants(farm, samples)
        assert max(attempts(farm).values()) <= 2
        log = w1.log.read_text()
        assert "took over" in log and "canary-lock" in log, log[-3000:]
        print(f"{len(samples)} samples finished {took_s:.1f}s after the lock holder's kill")
