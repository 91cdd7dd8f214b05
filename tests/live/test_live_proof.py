"""The per-sample proof against a live SGLang server (CPU engine): its own prompt logprobs,
asked in the dumped request, against the dump's final state; then a farm proving every
sample. Wrong final states are made from live dumps: rows shifted by one, another sample's
rows, and the pre-norm last layer (``h / w · rms``, as ``sglang_patch/faults.py`` does)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from engine_dump import engines
from engine_dump.dumpfile import DTYPE_BF16, T_AUX, T_HIDDEN, dump_path
from engine_dump.rids import make_rid
from producer.localfarm.farm import LocalFarm
from tests.conftest import CACHE, assert_farm_invariants, wait_finished
from tests.live.conftest import measured, running
from tests.live.sglang_server import LiveServer, post_json
from tests.live.test_live_farm import LIVE_FARM_ENV
from worker.core import proof
from worker.core.final_norm import read_final_norm

RUN = "0123456789abcdef"
TRIALS = 6


@pytest.fixture(scope="module")
def server(module_dir: Path, tiny_model: Path) -> Iterator[LiveServer]:
    server = LiveServer(tiny_model, module_dir, module_dir / "dumps",
                        extra=["--chunked-prefill-size", "64"])  # proven across chunks
    with running(server, "TP=1, chunk 64, for the proof"):
        yield server


def ask(server: LiveServer, key: str, ids: list[int]) -> tuple[np.ndarray, Path]:
    """One request as a proven sample's (``Engine.generate``): its logprobs and its dump."""
    rid = make_rid(key, 1, len(ids), run=RUN)
    path, body, _ = engines.sglang_engine({"model_path": "m"}).generate(rid, ids, None, True)
    answer = post_json(server.url, path, body, 300)
    said = engines.prompt_logprobs(engines.SGLANG, answer, ids)
    dump = server.dumps / f"{rid}.safetensors"
    deadline = time.monotonic() + 30
    while not dump.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return np.array([np.nan if v is None else v for v in said]), dump


def final_state(dump: Path) -> tuple[np.ndarray, np.ndarray]:
    """The dump's final state (float32, all rows) and its last aux layer."""
    t = load_file(str(dump))
    return t[T_HIDDEN].float().numpy(), t[T_AUX].float().numpy()


def test_live_logprobs_prove_right_rows_and_refute_wrong_ones(server: LiveServer,
                                                              tiny_model: Path) -> None:
    # Given the checkpoint's LM head and final norm, and samples of 40 to 300 tokens sent as
    # a proven sample's request (prompt logprobs asked), prefilled in chunks of 64
    head = proof.open_lm_head(tiny_model, 64)
    norm = read_final_norm(tiny_model, 64).as_float32()
    rng = np.random.default_rng(7)
    worst_right, least_wrong = 0.0, np.inf
    previous: np.ndarray | None = None
    for trial in range(TRIALS):
        ids = rng.integers(6, 600, int(rng.integers(40, 300))).tolist()
        server_lp, dump = ask(server, f"live-{trial}", ids)
        hidden, aux = final_state(dump)
        rows = proof.pick_rows(len(ids), 32, f"live-{trial}")
        arr = np.asarray(ids)

        # When the dump's rows are proven, and wrong ones made from them
        right = proof.prove(head, hidden[rows], rows, arr, server_lp, DTYPE_BF16)
        rms = np.sqrt((aux[:, -64:] ** 2).mean(axis=1, keepdims=True))
        other = previous if previous is not None else hidden[::-1]
        wrong = {
            "shifted": np.concatenate([hidden[1:], hidden[-1:]])[rows],
            "other sample": np.resize(other, hidden.shape)[rows],
            "pre-norm": (hidden / norm * rms)[rows],
        }
        verdicts = {k: proof.prove(head, h, rows, arr, server_lp, DTYPE_BF16)
                    for k, h in wrong.items()}

        # Then the right rows agree, and every wrong kind fails, on every trial
        assert right.ok, right.describe()
        for kind, v in verdicts.items():
            assert not v.ok, (trial, kind, v.describe())
            least_wrong = min(least_wrong, v.worst_error)
        worst_right = max(worst_right, right.worst_error)
        previous = hidden
        dump.unlink()
    # And the server's cost of the logprobs: the same ids, with and without
    ids = rng.integers(6, 600, 256).tolist()
    t0 = time.monotonic()
    plain = make_rid("plain", 1, 256, run=RUN)
    server.generate(plain, ids)
    t1 = time.monotonic()
    _, dump = ask(server, "asked", ids)
    t2 = time.monotonic()
    dump.unlink()  # the farm test after this one shares the dump dir
    deadline = time.monotonic() + 30
    while not dump_path(server.dumps, plain).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    dump_path(server.dumps, plain).unlink()
    measured(f"proof, live SGLang: a 256-token prefill {t1 - t0:.2f}s, with its prompt "
             f"logprobs {t2 - t1:.2f}s")
    measured(f"proof, live SGLang: {TRIALS} samples x 32 rows agree to |Δ logprob| <= "
             f"{worst_right:.3g}; shifted / other / pre-norm caught {TRIALS}/{TRIALS} each")


def test_live_farm_proves_every_sample(server: LiveServer, tmp_path: Path) -> None:
    # Given a farm against the live server that proves every sample
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, dumps=server.dumps,
                     server_port=server.port,
                     extra_env={**LIVE_FARM_ENV, "FARM_PROOF_RATE": "1"})
    try:
        farm.start_redis()
        farm.start_worker("w1", concurrency=2)
        # When 12 samples of 60 to 400 tokens run (a loaded 2-core machine prefills ~20
        # tokens/s in chunks of 64)
        data = tmp_path / "data.json"
        data.write_text(json.dumps([{"id": f"p-{i}", "messages": [
            {"role": "user", "content": f"question {i}: " + "why " * (10 + 12 * i)},
            {"role": "assistant", "content": f"answer {i} " + "because " * (5 + 10 * i)}]}
            for i in range(12)]))
        assert farm.cli("enqueue", str(data), "--no-progress").returncode == 0
        keys = [f"p-{i}" for i in range(12)]
        wait_finished(farm, 12, timeout_s=600)
        # Then every one was proven and is done: no false alarm
        assert_farm_invariants(farm, keys)
        log = farm.procs["w1"].log.read_text(errors="replace")
        passed = re.findall(r" proof: (\d+) rows agree \(worst \|Δ logprob\| (\S+),", log)
        assert len(passed) == 12 and "fails the proof" not in log, log[-3000:]
        worst = max(float(w) for _, w in passed)
        measured(f"proof, live farm: 12/12 samples proven, {sum(int(n) for n, _ in passed)} "
                 f"rows, worst |Δ logprob| {worst:.3g}, 0 false alarms")
    finally:
        farm.close()
