"""The farm against a live vLLM server: enqueue → workers → verified files → a trainer's loader.

Run from the farm's venv (Celery, Redis, the workers as on a worker host); the server is
.venv-vllm's (``HSFARM_VLLM_PYTHON``), started by ops/launch-vllm.sh, restarted by tests:
killed mid-run, another checkpoint of the same config, fp8 dumps. Nothing here tells the
workers which engine they talk to: they find it from the server. ``make test-vllm``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine_dump.dumpfile import DTYPE_FP8, DUMP_SUFFIX, T_AUX, T_HIDDEN, T_INPUT_IDS
from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import EXAMPLES, FAST_ENV, assert_farm_invariants, wait_finished
from tests.vllm.conftest import measured
from tests.vllm.live import AUX_IDS, LiveVllm
from tests.vllm.reference import reference, rel_errors
from worker.core import outdir
from worker.state.queue_scan import broker_depth

ROOT = Path(__file__).resolve().parents[3]
SPECFORGE_PYTHON = ROOT / ".venv-specforge" / "bin" / "python"
BF16_TOLERANCE = 2.0**-8  # per token: one bf16 rounding of transformers' float32 value
FP8_TOLERANCE = 0.05  # per token and layer, as for the hook's own fp8 dumps
# The farm's view of the tiny vLLM model: its aux ids (vLLM's sorted, distinct ones); samples
# longer than the server's context (2048: a prompt and the one token vLLM generates) are cut
# to what the server says it takes
FARM_ENV = {**FAST_ENV, "FARM_LAYERS_TO_CAPTURE": ",".join(map(str, AUX_IDS)),
            "FARM_OVERLONG": "truncate"}


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveVllm]:
    base = tmp_path_factory.mktemp("vllm")
    server = LiveVllm(model, base / "dumps", base / "server.log", via_script=True)
    server.start()
    measured(f"farm server (ops/launch-vllm.sh): healthy {server.start_s:.0f}s after its start")
    try:
        yield server
    finally:
        server.stop()


def fine_tune(base: Path, out: Path) -> Path:
    """``base`` with its token embeddings moved (every hidden state changes), the same config
    and tokenizer: another checkpoint a restart could load by mistake."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    tensors["model.embed_tokens.weight"] += 0.05
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def restart(server: LiveVllm, model: Path, env: dict[str, str] | None = None) -> None:
    """The same server (port, dump dir) again, on ``model`` and with ``env``."""
    server.stop()
    server.model, server.env = model, env or {}
    server.start()


@pytest.fixture(scope="module")
def farm(server: LiveVllm, model: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[LocalFarm]:
    """A farm (private Redis, one worker of two processes) on ``server``: the run's model is
    the one the server loaded, as FARM_MODEL_PATH says."""
    f = LocalFarm(tmp_path_factory.mktemp("farm"), model=str(model), dumps=server.dumps,
                  server_port=server.port,
                  extra_env={**FARM_ENV, "FARM_MODEL_PATH": str(model)})
    try:
        f.start_redis()
        f.start_worker("w1", concurrency=2)
        yield f
    finally:
        f.close(kill=True)


def compare(files: list[Path], model: Path, tolerance: float, case: str) -> None:
    """Every file's states against transformers float32, per layer: max and mean of the
    per-token relative error, recorded."""
    errors: list[list[torch.Tensor]] = [[] for _ in range(len(AUX_IDS) + 1)]
    for path in files:
        t = load_file(str(path))
        for name in (T_HIDDEN, T_AUX):  # an fp8 run: e4m3 times its scale, by definition
            scale = t.get(f"{name}_scale")
            if scale is not None:
                n, layers = scale.shape
                t[name] = (t[name].float().view(n, layers, -1) * scale[:, :, None]).view(n, -1)
        ids = t[T_INPUT_IDS].tolist()
        post, _, inputs = reference(model, ids, AUX_IDS)
        n, h = len(ids), post.shape[1]
        got = [*t[T_AUX].view(n, len(AUX_IDS), h).unbind(1), t[T_HIDDEN]]
        for i, (g, want) in enumerate(zip(got, [*inputs, post], strict=True)):
            errors[i].append(rel_errors(g, want))
    names = [f"aux id {k}" for k in AUX_IDS] + ["hidden_state"]
    for name, errs in zip(names, errors, strict=True):
        e = torch.cat(errs)
        measured(f"{case:<28} {name:<14} max {float(e.max()):.2e}  mean {float(e.mean()):.2e}")
        assert float(e.max()) < tolerance, (name, float(e.max()))


def finals(farm: LocalFarm) -> list[Path]:
    return sorted((farm.output_dir / "samples").rglob(f"*{DUMP_SUFFIX}"))


@pytest.fixture(scope="module")
def enqueued() -> list[str]:
    """Every sample key the module's farm was given, in order (each test adds its own)."""
    return []


SHORT = [s for s in json.loads(EXAMPLES.read_text())
         if len(json.dumps(s, ensure_ascii=False)) < 3000]


def add(farm: LocalFarm, enqueued: list[str], n: int) -> list[str]:
    """Enqueue the next ``n`` example samples that fit vLLM's 2048-token context (the
    examples' longest would be cut to it with no assistant token left, and rejected); keys."""
    samples = SHORT[len(enqueued): len(enqueued) + n]
    path = farm.work_dir / f"data-{len(enqueued)}.json"
    path.write_text(json.dumps(samples, ensure_ascii=False))
    res = farm.cli("enqueue", str(path), "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    enqueued += [str(s["id"]) for s in samples]
    return [str(s["id"]) for s in samples]


def test_the_farm_extracts_through_vllm_and_specforges_loader_reads_the_export(
        farm: LocalFarm, model: Path, enqueued: list[str]) -> None:
    # Given a farm whose worker found a vLLM server (nothing in its settings says so)
    log = farm.procs["w1"].log.read_text()
    assert f"{farm.env()['FARM_SERVER_URL']} (vLLM 0.32." in log, log[-3000:]
    # When 12 example samples are enqueued
    add(farm, enqueued, 12)
    wait_finished(farm, len(enqueued))
    # Then each has one verified file, nothing failed or left behind, and each file holds
    # transformers' states of its tokens (one bf16 rounding)
    assert_farm_invariants(farm, enqueued)
    compare(finals(farm), model, BF16_TOLERANCE, "farm via vLLM, bf16")
    # And the worker read vLLM's context for its cut (FARM_OVERLONG=truncate)
    assert "takes at most 2047 tokens" in log
    # And SpecForge's own reader, store, normalizer and collator read the export as ours
    data = farm.work_dir / "trainer-data"
    data.mkdir()
    (data / "out").symlink_to(farm.output_dir)
    # (with torch, as on a training host: SpecForge's container is torch.save's)
    res = subprocess.run([sys.executable, "-m", "producer", "export", "--to", "specforge",
                          "--no-progress", str(data / "specforge")], env=farm.env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (data / ".complete").write_text("ok\n")
    assert SPECFORGE_PYTHON.exists(), "no .venv-specforge: make .venv-specforge/.installed"
    test = "tests/trainers/test_specforge.py::test_its_loader_and_collator_give_our_tensors_" \
           "after_its_transforms"
    res = subprocess.run([str(SPECFORGE_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--confcutdir", "tests/trainers", test], cwd=ROOT, capture_output=True,
                         text=True, timeout=600,
                         env={**os.environ, "HSFARM_TRAINER_DATA": str(data),
                              "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr


def test_a_vllm_server_killed_mid_run_loses_nothing(farm: LocalFarm, server: LiveVllm,
                                                   model: Path, enqueued: list[str]) -> None:
    # Given 16 more samples in flight
    before = len(finals(farm))
    add(farm, enqueued, 16)
    wait_until(lambda: len(finals(farm)) >= before + 2, 120, "two samples to be written")
    # When the server and its engine processes are SIGKILLed, and started again later
    server.kill()
    time.sleep(3)
    restart(server, model)
    # Then the run finishes: every sample once, verified, nothing failed or left behind
    wait_finished(farm, len(enqueued))
    assert_farm_invariants(farm, enqueued)


def test_another_checkpoint_is_refused_by_the_canary_and_its_identity(
        farm: LocalFarm, server: LiveVllm, model: Path, tmp_path: Path,
        enqueued: list[str]) -> None:
    # Given the run's worker running, and a fine-tune of the run's model (same config)
    tuned = fine_tune(model, tmp_path / "tuned")
    w1 = farm.procs["w1"]
    done = len(finals(farm))
    # When the server restarts on it, and more samples are queued
    restart(server, tuned)
    more = add(farm, enqueued, 4)
    # Then the running worker's canary sees other states: it pauses, writing nothing
    wait_until(lambda: "CANARY MISMATCH" in w1.log.read_text(), 120, "w1 to see it")
    # And a worker starting now refuses the server by its weights identity (exit 2)
    w2 = farm.start_worker("w2", concurrency=1, wait=False)
    wait_until(lambda: not w2.alive(), 120, "w2 to refuse the server")
    log = w2.log.read_text()
    assert w2.popen is not None and w2.popen.returncode == 2, log[-3000:]
    assert "but the run's weights are" in log and " ready." not in log
    assert len(finals(farm)) == done and sum(broker_depth(farm.redis(), farm.queue())) == 4
    # When the run's model is served again, the run finishes
    restart(server, model)
    wait_finished(farm, len(enqueued))
    assert all(outdir.final_path(farm.output_dir, k).exists() for k in more)
    assert_farm_invariants(farm, enqueued)


@pytest.mark.timeout(900)  # two server starts (vLLM's takes minutes on a loaded CPU)
def test_a_server_restarted_as_another_engine_is_found_again(
        farm: LocalFarm, server: LiveVllm, model: Path, enqueued: list[str]) -> None:
    # Given the run's worker, which found vLLM at FARM_SERVER_URL
    w1 = farm.procs["w1"]
    assert w1.alive()
    # When the server restarts as the reference server (SGLang's API: /v1/completions is a
    # 404 there) on the same port, dump dir and checkpoint, and samples are queued
    server.stop()
    farm.start_server(["--layers-to-capture", *map(str, AUX_IDS)])
    add(farm, enqueued, 5)
    # Then the worker asks which engine serves, and the samples are done through it
    wait_finished(farm, len(enqueued), timeout_s=240)
    # When vLLM serves there again (/generate is a 404 there), and more samples are queued
    farm.procs["server"].stop()
    restart(server, model)
    add(farm, enqueued, 5)
    # Then they are done through vLLM, by the same worker: nothing failed or left behind
    wait_finished(farm, len(enqueued), timeout_s=240)
    assert w1.alive()
    assert_farm_invariants(farm, enqueued)


def test_an_fp8_run_stores_vllms_fp8_dumps(server: LiveVllm, model: Path,
                                           tmp_path: Path) -> None:
    # Given the server dumping fp8, and a run storing fp8
    restart(server, model, {"FARM_STORE_DTYPE": DTYPE_FP8})
    f = LocalFarm(tmp_path / "farm", model=str(model), dumps=server.dumps,
                  server_port=server.port,
                  extra_env={**FARM_ENV, "FARM_MODEL_PATH": str(model),
                             "FARM_STORE_DTYPE": DTYPE_FP8})
    try:
        f.start_redis()
        f.start_worker("w1", concurrency=2)
        keys = add(f, [], 6)
        wait_finished(f, 6)
        # Then the files are whole, and within e4m3's rounding of transformers' states
        assert_farm_invariants(f, keys)
        compare(finals(f), model, FP8_TOLERANCE, "farm via vLLM, fp8")
    finally:
        f.close(kill=True)
