"""The whole farm against a live SGLang server started by ``ops/launch-sglang.sh``: real Redis,
real ``celery -A worker worker`` processes, real dumps; then the server SIGKILLed mid-run and
started again by the test (the canary recorded before the kill passes after it)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS, is_temp_name
from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import CACHE, FAST_ENV, assert_farm_invariants, wait_finished
from tests.live.conftest import measured, running
from tests.live.reference import BF16_TOLERANCE, reference, relative_error
from tests.live.sglang_server import LiveServer
from tests.support.faults import enqueue, run_hash, text
from training.sample_file import SampleFile
from worker.core import outdir
from worker.core.finalfile import conversation_of
from worker.state import keys as k

# A live CPU server prefills a 4,451-token sample in seconds, not milliseconds, and a restart
# takes a minute: longer limits than the reference server's, the same logic.
LIVE_FARM_ENV = {**FAST_ENV, "FARM_REQUEST_TIMEOUT_S": "120", "FARM_DUMP_TIMEOUT_S": "30",
                 "FARM_TASK_TIME_LIMIT_S": "180", "FARM_VISIBILITY_TIMEOUT_S": "240",
                 "FARM_SERVER_WAIT_S": "60"}


@pytest.fixture(scope="module")
def server(module_dir: Path, tiny_model: Path) -> Iterator[LiveServer]:
    # chunk budget 8192, the default on an H200: the example samples run unchunked, as most
    # of a real run's do
    server = LiveServer(tiny_model, module_dir, module_dir / "dumps", via_script=True,
                        extra=["--chunked-prefill-size", "8192"])
    with running(server, "TP=1 by ops/launch-sglang.sh (its verify probe passed)"):
        yield server


@pytest.fixture
def farm(tmp_path: Path, server: LiveServer) -> Iterator[LocalFarm]:
    """A private Redis; workers as tests start them; the module's live server."""
    f = LocalFarm(tmp_path / "farm", cache_dir=CACHE, dumps=server.dumps,
                  server_port=server.port, extra_env=dict(LIVE_FARM_ENV))
    try:
        f.start_redis()
        yield f
    finally:
        f.close()


def done_keys(farm: LocalFarm) -> set[str]:
    r = farm.redis()
    zsets = r.scan_iter(f"{k.PREFIX}:*:{k.DONE}")
    return {text(m) for z in zsets for m in cast(list[bytes], r.zrange(z, 0, -1))}


def extractions(farm: LocalFarm) -> dict[str, int]:
    """How many times each sample was extracted to a verified file (workers' log lines)."""
    counts: dict[str, int] = {}
    for proc in farm.procs.values():
        if proc.name.startswith("w"):
            for m in re.finditer(r" (\S+) a\d+ done n=", proc.log.read_text(errors="replace")):
                counts[m[1]] = counts.get(m[1], 0) + 1
    return counts


def assert_matches_transformers(farm: LocalFarm, keys: list[str], model: Path) -> float:
    """Every final file holds transformers' states for its ids; returns the worst error."""
    worst = 0.0
    for key in keys:
        t = load_file(str(outdir.final_path(farm.output_dir, key)))
        hidden, aux = reference(model, t[T_INPUT_IDS].tolist(), [2, 4, 5])
        assert t[T_HIDDEN].dtype == torch.bfloat16 and t[T_AUX].shape == aux.shape
        err = max(relative_error(t[T_HIDDEN], hidden), relative_error(t[T_AUX], aux))
        assert err < BF16_TOLERANCE, (key, err)
        worst = max(worst, err)
    return worst


def test_farm_end_to_end_against_live_sglang(farm: LocalFarm, tmp_path: Path,
                                             tiny_model: Path) -> None:
    # Given 20 example samples (94 to 4,451 tokens) and two workers of two processes
    farm.start_worker("w1", concurrency=2)
    farm.start_worker("w2", concurrency=2)
    # When they are enqueued and the farm runs to the end against the live server
    keys = enqueue(farm, tmp_path, 20)
    wait_finished(farm, 20, timeout_s=600)
    # Then every sample has one verified file, audit finds the run whole, nothing is left
    assert_farm_invariants(farm, keys)
    assert extractions(farm) == dict.fromkeys(keys, 1)
    # And each file holds the live server's states, equal to transformers' for its ids
    worst = assert_matches_transformers(farm, keys, tiny_model)
    measured(f"farm, 20 samples through 2 workers x 2 processes: audit whole, worst error "
             f"{worst:.4f}")


def test_a_regenerating_farm_extracts_the_live_servers_own_replies(
        server: LiveServer, tmp_path: Path, tiny_model: Path, tokenizer: Any) -> None:
    # Given a farm that regenerates each assistant turn (12 new tokens, sampled) before it
    # extracts, against the live server, and 6 samples of 1 to 4 user turns
    f = LocalFarm(tmp_path / "farm", cache_dir=CACHE, dumps=server.dumps,
                  server_port=server.port, extra_env={
                      **LIVE_FARM_ENV, "FARM_REGENERATE": "1", "FARM_GEN_MAX_NEW_TOKENS": "12",
                      "FARM_GEN_TEMPERATURE": "0.8", "FARM_GEN_ON_LENGTH": "keep"})
    try:
        f.start_redis()
        f.start_worker("w1", concurrency=2)
        # When they are enqueued and the farm runs to the end
        keys = enqueue(f, tmp_path, 6)
        wait_finished(f, 6, timeout_s=600)
        # Then every sample has one verified file, audit finds the run whole against its
        # regenerated conversations, and each file's states are the live server's, equal to
        # transformers' for the regenerated conversation's ids
        assert_farm_invariants(f, keys)
        worst = assert_matches_transformers(f, keys, tiny_model)
        turns = 0
        for key in keys:
            meta = SampleFile.open(outdir.final_path(f.output_dir, key)).metadata
            conv = conversation_of(meta)
            assert conv is not None
            ids = load_file(str(outdir.final_path(f.output_dir, key)))[T_INPUT_IDS].tolist()
            assert ids == tokenizer.apply_chat_template(conv["messages"], tokenize=True,
                                                        return_dict=False)
            for t in conv["generation"]["turns"]:  # SGLang's own output, its end included
                assert 1 <= len(t["output_ids"]) <= 12 and t["finish"] in ("stop", "length")
                turns += 1
        measured(f"regenerating farm, 6 samples, {turns} turns generated by live SGLang, then "
                 f"extracted: audit whole, worst error {worst:.4f}")
    finally:
        f.close()


def test_server_sigkilled_mid_run_and_restarted(farm: LocalFarm, server: LiveServer,
                                                tmp_path: Path) -> None:
    # Given 24 other samples being extracted by a worker
    farm.start_worker("w1", concurrency=2)
    keys = enqueue(farm, tmp_path, 24, start=20)
    wait_until(lambda: len(done_keys(farm)) >= 3 and bool(run_hash(farm, k.RUNNING)), 300,
               "some samples done and others running", poll_s=0.05)
    # When every process of the server is SIGKILLed mid-run, and it is started again (same
    # port, same dump dir; directly this time, so nothing but the new hook cleans up after
    # the killed one)
    server.kill()
    done_at_kill = len(done_keys(farm))
    server.via_script = False
    server.start()
    measured(f"server SIGKILLed with {done_at_kill}/24 done; back in {server.started_s:.1f}s")
    wait_finished(farm, 24, timeout_s=600)
    # Then every sample was extracted exactly once into one verified file, nothing is left in
    # tmpfs, and the killed server's marker is gone: the new hook removed it
    assert done_at_kill < 24
    assert_farm_invariants(farm, keys)
    assert extractions(farm) == dict.fromkeys(keys, 1)
    assert not [p for p in server.dumps.iterdir() if is_temp_name(p.name)]
    markers = server.markers()
    assert len(markers) == 1 and Path(f"/proc/{_pid(markers[0])}").exists(), markers
    # And the workers saw the server go away and waited for it, without failing anything
    log = farm.procs["w1"].log.read_text(errors="replace")
    assert re.search(r"server .*(does not answer|unreachable|unavailable)", log), log[-2000:]
    # And the canary the worker recorded at its start was checked again against the restarted
    # server by a pool process, and passed (the same model: a restart is not a new model)
    assert "recorded the run's canary" in log
    rechecks = re.findall(r"ForkPoolWorker\S* hsfarm.canary: canary passed: .*", log)
    assert rechecks, log[-3000:]
    measured(f"canary after the restart: {rechecks[0].split(': ', 1)[1]}")


def _pid(marker: Path) -> int:
    return int(marker.name.rsplit(".", 1)[1])
