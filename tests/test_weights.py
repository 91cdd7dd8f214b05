"""The weights identity: another checkpoint of the same config, or a truncated shard, is
refused when the output dir is opened, before any request; old manifests still open."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from sglang_patch.tiny_model import ensure_tiny_model
from tests.conftest import CACHE
from worker.core import outdir, weights
from worker.core.errors import ConfigError
from worker.core.settings import Settings
from worker.core.store import OutputStore
from worker.server.fingerprint import compute_fingerprint


@pytest.fixture(scope="module")
def other_model() -> Path:
    """The tiny model's config and tokenizer with other weights (a 'fine-tune')."""
    return ensure_tiny_model(CACHE, seed=1)


def _store(out: Path, model: Path) -> OutputStore:
    return OutputStore(out, compute_fingerprint(Settings(), model), model_path=model)


def test_identity_tells_another_checkpoint_of_the_same_config(tiny_model: Path,
                                                              other_model: Path) -> None:
    # Given two checkpoints with the same config and tokenizer (one fingerprint)
    assert compute_fingerprint(Settings(), tiny_model) == compute_fingerprint(Settings(),
                                                                              other_model)
    a, b = weights.weights_identity(tiny_model), weights.weights_identity(other_model)
    # Then their identities differ in the sampled bytes; each equals itself
    assert a["id"] != b["id"]
    assert weights.differences(a, b) == ["model.safetensors: sampled bytes differ"]
    assert weights.differences(a, weights.weights_identity(tiny_model)) == []
    shard = a["shards"][0]
    assert shard["size"] == (tiny_model / "model.safetensors").stat().st_size


def test_sampled_ranges_cover_a_large_shard_sparsely() -> None:
    offsets = weights.sample_offsets(1000, 600 << 30)
    assert len(offsets) == weights.SAMPLES and offsets[0] == 1000
    assert offsets[-1] == (600 << 30) - weights.SAMPLE_BYTES  # the end is read too
    assert offsets == sorted(offsets)


def test_open_refuses_another_checkpoint_before_anything_is_written(
        tmp_path: Path, tiny_model: Path, other_model: Path) -> None:
    # Given an output dir opened with the tiny model: the manifest records its identity
    out = tmp_path / "out"
    first = _store(out, tiny_model).open()
    manifest = json.loads((out / outdir.MANIFEST).read_text())
    assert manifest["weights"]["id"] == first.weights_id == first.recorded_weights_id()
    # When it is opened with another checkpoint of the same config
    with pytest.raises(ConfigError) as e:
        _store(out, other_model).open()
    # Then it is refused, naming the shard and both ways on
    assert "sampled bytes differ" in str(e.value) and "model.safetensors" in str(e.value)
    assert "Restore the original checkpoint" in str(e.value)
    assert "new FARM_OUTPUT_DIR" in str(e.value)
    # And the same model opens again
    assert _store(out, tiny_model).open().weights_id == first.weights_id


def test_truncated_shard_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    # Given a copy of the model whose shard lost its tail (a full disk, an interrupted copy)
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    shard = model / "model.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 4096)
    # Then even a new run refuses it, saying so
    with pytest.raises(ConfigError, match="truncated or damaged"):
        _store(tmp_path / "out", model).open()
    assert not (tmp_path / "out" / outdir.MANIFEST).exists()


def test_manifest_without_identity_still_opens(tmp_path: Path, tiny_model: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    # Given an output dir of a run started before the weights identity existed
    out = tmp_path / "out"
    _store(out, tiny_model).open()
    manifest = json.loads((out / outdir.MANIFEST).read_text())
    del manifest["weights"]
    (out / outdir.MANIFEST).write_text(json.dumps(manifest))
    # When a worker opens it
    store = _store(out, tiny_model).open()
    # Then it keeps running, says what cannot be checked, and tags new files with the identity
    assert store.weights_id == weights.weights_identity(tiny_model)["id"]
    assert store.recorded_weights_id() is None
    assert "records no weights identity" in caplog.text


def test_a_host_without_the_weight_files_or_another_scheme_is_not_refused(
        tmp_path: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Given a run recorded where the weights are
    out = tmp_path / "out"
    recorded = _store(out, tiny_model).open().weights_id
    # When a host whose model dir holds only the config and tokenizer opens it
    light = tmp_path / "tokenizer-only"
    shutil.copytree(tiny_model, light, ignore=shutil.ignore_patterns("*.safetensors"))
    store = _store(out, light).open()
    # Then it is not refused (the canary guards the served model) and tags files as the run
    assert store.weights_id == recorded
    assert "no *.safetensors weight files" in caplog.text
    # And an identity of another scheme (another hsfarm version) is not a mismatch either
    manifest = json.loads((out / outdir.MANIFEST).read_text())
    manifest["weights"]["scheme"] = "hsfarm-weights-0"
    (out / outdir.MANIFEST).write_text(json.dumps(manifest))
    assert _store(out, tiny_model).open().weights_id == recorded
    assert "identity scheme" in caplog.text


# --- the server's weights against the run's ------------------------------------------------------

def fine_tune(base: Path, out: Path) -> Path:
    """``base`` with one tensor perturbed (its largest: a fine-tune's change that the sampled
    ranges see): the same config and tokenizer, other weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    name = max(tensors, key=lambda k: tensors[k].numel())
    tensors[name] = tensors[name] + 0.05
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_server_serving_other_weights_than_the_run_is_refused_at_first_and_later_starts(
        tmp_path: Path, tiny_model: Path) -> None:
    from producer.localfarm.farm import wait_until
    from tests.conftest import wait_finished
    from tests.faults import enqueue, running_farm
    from worker.state.queue_scan import broker_depth

    tuned = fine_tune(tiny_model, tmp_path / "tuned")
    assert weights.weights_identity(tuned)["id"] != weights.weights_identity(tiny_model)["id"]
    # Given the server serving the fine-tune while the workers' FARM_MODEL_PATH holds the base
    with running_farm(tmp_path, server_args=["--model", str(tuned)],
                      env={"FARM_MODEL_PATH": str(tiny_model)}) as farm:
        keys = enqueue(farm, tmp_path, 4)
        queue, out = farm.queue(), farm.output_dir

        def refused(name: str, files: int) -> str:
            w = farm.start_worker(name, concurrency=1, wait=False)
            wait_until(lambda: not w.alive() or b" ready." in w.log.read_bytes(), 120,
                       f"worker {name} to start or stop")
            time.sleep(1)
            log = w.log.read_text()
            assert not w.alive() and w.popen is not None and w.popen.returncode == 2, log[-3000:]
            assert " ready." not in log
            assert broker_depth(farm.redis(), queue) == (4, 0)
            assert len(list((out / "samples").rglob("*.safetensors"))) == files
            return log

        # When a worker starts for the first time: it exits 2 before taking anything, naming
        # both identities and both ways on (no hidden states were written under the run yet)
        log = refused("first", 0)
        tuned_id = weights.weights_identity(tuned)["id"]
        base_id = weights.weights_identity(tiny_model)["id"]
        assert f"the server at {farm.env()['FARM_SERVER_URL']} serves weights {tuned_id}" in log
        assert f"FARM_MODEL_PATH={tiny_model} holds {base_id}" in log
        assert "serve the checkpoint of FARM_MODEL_PATH" in log
        assert f"remove {out / outdir.MANIFEST}" in log
        assert not (out / "canary.safetensors").exists()
        # And once the server serves the base, the run works
        farm.procs["server"].stop()
        farm.start_server(["--model", str(tiny_model)])
        farm.start_worker("good", concurrency=1)
        wait_finished(farm, 4)
        assert len(list((out / "samples").rglob("*.safetensors"))) == len(keys)
        farm.procs["good"].stop()
        # When the server is later restarted with the fine-tune, a worker's start refuses it
        # too, and the fix names the server: the run's weights are the base's
        more = enqueue(farm, tmp_path, 4, start=4)
        assert len(more) == 4
        farm.procs["server"].stop()
        farm.start_server(["--model", str(tuned)])
        log = refused("later", 4)
        assert f"serves weights {tuned_id}" in log and f"the run's weights are {base_id}" in log
        assert "restart the server with the run's checkpoint" in log
