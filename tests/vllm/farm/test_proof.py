"""The per-sample proof against a live vLLM server (CPU), from the farm's interpreter as a
worker runs it: ``prompt_logprobs`` asked in the dumped request (``Engine.generate``), against
the hook's dump of it; wrong final states made from live dumps (rows shifted by one, another
sample's rows, the pre-norm last layer) fail."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from engine_dump import engines
from engine_dump.dumpfile import DTYPE_BF16, T_AUX, T_HIDDEN
from engine_dump.rids import make_rid
from producer.localfarm.farm import LocalFarm
from tests.conftest import assert_farm_invariants, wait_finished
from tests.vllm.conftest import measured
from tests.vllm.farm.test_farm import FARM_ENV, SHORT
from tests.vllm.live import LiveVllm, prompt, vocab, wait_dump
from worker.core import proof
from worker.core.final_norm import read_final_norm

pytestmark = pytest.mark.timeout(600)
RUN = "0123456789abcdef"
TRIALS = 6


def ask(server: LiveVllm, key: str, ids: list[int]) -> tuple[np.ndarray, Path, float]:
    """One request as a proven sample's: its prompt logprobs, its dump, its seconds."""
    rid = make_rid(key, 1, len(ids), run=RUN)
    engine = engines.vllm_engine({"data": [{"id": "m", "max_model_len": 2048}]}, "")
    assert engine is not None
    path, body, headers = engine.generate(rid, ids, None, prompt_logprobs=True)
    req = urllib.request.Request(f"{server.url}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **headers})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.loads(r.read())
    took = time.monotonic() - t0
    said = engines.prompt_logprobs(engines.VLLM, answer, ids)
    return np.array([np.nan if v is None else v for v in said]), wait_dump(server.dumps, rid), \
        took


def test_vllm_prompt_logprobs_prove_right_rows_and_refute_wrong_ones(plain: LiveVllm,
                                                                     model: Path) -> None:
    # Given the checkpoint's LM head and final norm, and prompts of 40 to 400 tokens sent
    # as a proven sample's request
    h = int(json.loads((model / "config.json").read_text())["hidden_size"])
    head = proof.open_lm_head(model, h)
    norm = read_final_norm(model, h).as_float32()
    rng = np.random.default_rng(11)
    worst_right, previous = 0.0, None
    for trial in range(TRIALS):
        ids = prompt(int(rng.integers(40, 400)), 100 + trial, vocab(model))
        server_lp, dump, _ = ask(plain, f"vp-{trial}", ids)
        t = load_file(str(dump))
        hidden, aux = t[T_HIDDEN].float().numpy(), t[T_AUX].float().numpy()
        dump.unlink()  # the session's server: later tests share its dump dir
        rows = proof.pick_rows(len(ids), 32, f"vp-{trial}")
        arr = np.asarray(ids)

        # When its rows are proven, and wrong ones made from them
        right = proof.prove(head, hidden[rows], rows, arr, server_lp, DTYPE_BF16)
        rms = np.sqrt((aux[:, -h:] ** 2).mean(axis=1, keepdims=True))
        other = previous if previous is not None else hidden[::-1]
        wrong = {"shifted": np.concatenate([hidden[1:], hidden[-1:]])[rows],
                 "other sample": np.resize(other, hidden.shape)[rows],
                 "pre-norm": (hidden / norm * rms)[rows]}

        # Then the right rows agree and every wrong kind fails, on every trial
        assert right.ok, right.describe()
        for kind, x in wrong.items():
            v = proof.prove(head, x, rows, arr, server_lp, DTYPE_BF16)
            assert not v.ok, (trial, kind, v.describe())
        worst_right = max(worst_right, right.worst_error)
        previous = hidden
    # And the server's cost: the same prompt, with and without the logprobs
    ids = prompt(384, 7, vocab(model))
    t0 = time.monotonic()
    rid = make_rid("plain", 1, 384, run=RUN)
    plain.complete(ids, rid)
    plain_s = time.monotonic() - t0
    _, dump, asked_s = ask(plain, "asked", ids)
    dump.unlink()
    wait_dump(plain.dumps, rid).unlink()
    measured(f"proof, live vLLM: {TRIALS} samples x 32 rows agree to |Δ logprob| <= "
             f"{worst_right:.3g}; shifted / other / pre-norm caught {TRIALS}/{TRIALS} each; "
             f"a 384-token request {plain_s:.2f}s, with prompt logprobs {asked_s:.2f}s")


def test_vllm_farm_proves_every_sample(plain: LiveVllm, model: Path, tmp_path: Path) -> None:
    # Given a farm on the live vLLM server that proves every sample
    farm = LocalFarm(tmp_path / "farm", model=str(model), dumps=plain.dumps,
                     server_port=plain.port,
                     extra_env={**FARM_ENV, "FARM_MODEL_PATH": str(model),
                                "FARM_PROOF_RATE": "1"})
    try:
        farm.start_redis()
        farm.start_worker("w1", concurrency=2)
        # When 10 short example samples run
        samples = SHORT[:10]
        data = tmp_path / "data.json"
        data.write_text(json.dumps(samples, ensure_ascii=False))
        assert farm.cli("enqueue", str(data), "--no-progress").returncode == 0
        keys = [str(s["id"]) for s in samples]
        wait_finished(farm, 10, timeout_s=400)
        # Then every one was proven through vLLM's prompt_logprobs and is done: no false alarm
        assert_farm_invariants(farm, keys)
        log = farm.procs["w1"].log.read_text(errors="replace")
        passed = re.findall(r" proof: (\d+) rows agree \(worst \|Δ logprob\| (\S+),", log)
        assert len(passed) == 10 and "fails the proof" not in log, log[-3000:]
        measured(f"proof, vLLM farm: 10/10 samples proven, {sum(int(n) for n, _ in passed)} "
                 f"rows, worst |Δ logprob| {max(float(w) for _, w in passed):.3g}, "
                 "0 false alarms")
    finally:
        farm.close(kill=True)
