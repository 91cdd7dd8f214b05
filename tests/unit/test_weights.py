"""The weights identity: another checkpoint of the same config, or a truncated shard, is
refused when the output dir is opened, before any request; old manifests still open, and a
host without the weight files is not refused. Files only; no server.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from sglang_patch.tiny_model import ensure_tiny_model
from tests.conftest import CACHE
from tests.support.checkpoints import bos_row_changed
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


def test_a_change_to_one_embedding_row_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    # Given a copy of the checkpoint whose only change is the BOS token's embedding row
    # (its bytes lie between the sampled ranges)
    changed = bos_row_changed(tiny_model, tmp_path / "bos")
    # Then its identity differs from the original's, saying which shard's bytes differ
    a, b = weights.weights_identity(tiny_model), weights.weights_identity(changed)
    assert a["id"] != b["id"]
    assert weights.differences(a, b) == ["model.safetensors: data bytes differ"]
    # And a run recorded with the original refuses it before anything is written
    out = tmp_path / "out"
    _store(out, tiny_model).open()
    with pytest.raises(ConfigError, match="data bytes differ"):
        _store(out, changed).open()


def test_the_data_hash_is_cached_by_file_identity(tmp_path: Path, tiny_model: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_dump import weights_hash

    # Given a checkpoint hashed once: its digest is cached beside it
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns(".hsfarm-*"))
    first = weights.weights_identity(model)
    cache = model / weights_hash.CACHE_NAME
    body = json.loads(cache.read_text())
    [key] = body["entries"]
    # When the cached digest is replaced by another: the next identity takes it unread
    body["entries"][key][weights_hash.ALGORITHM] = "0" * 32
    cache.write_text(json.dumps(body))
    assert weights.weights_identity(model)["shards"][0]["data_xxh3_128"] == "0" * 32
    # When the shard is rewritten in place with its mtime set back (same inode, size, mtime)
    shard = model / "model.safetensors"
    st = shard.stat()
    shard.write_bytes(shard.read_bytes())
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    # Then the cache misses (the ctime moved) and every byte is read again
    assert weights.weights_identity(model)["shards"][0]["data_xxh3_128"] \
        == first["shards"][0]["data_xxh3_128"]
    # And a checkpoint in a dir this process cannot write caches in XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    assert weights_hash.cache_path(model).parent == tmp_path / "xdg" / "hsfarm" / "weights"
    assert weights.weights_identity(model)["id"] == first["id"]
    assert list((tmp_path / "xdg" / "hsfarm" / "weights").glob(f"*{weights_hash.CACHE_NAME}"))


def test_a_run_recorded_under_the_older_scheme_is_compared_on_its_fields(
        tmp_path: Path, tiny_model: Path, other_model: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a run whose manifest records a shards-v1 identity (no data hash), as an older
    # hsfarm wrote it
    out = tmp_path / "out"
    _store(out, tiny_model).open()
    manifest = json.loads((out / outdir.MANIFEST).read_text())
    shards = manifest["weights"]["shards"]
    v1 = {"scheme": "shards-v1",
          "shards": [{k: v for k, v in s.items() if k != "data_xxh3_128"} for s in shards]}
    v1["id"] = "00112233aabbccdd"
    manifest["weights"] = v1
    (out / outdir.MANIFEST).write_text(json.dumps(manifest))
    # When a worker opens it with the same checkpoint: it runs, files carry the run's id, and
    # the log says what the older identity cannot see
    store = _store(out, tiny_model).open()
    assert store.weights_id == "00112233aabbccdd"
    assert "shards-v1" in caplog.text and "one embedding row" in caplog.text
    # And its server's dumps are held to the identity this hsfarm computes of the same
    # checkpoint (a server never publishes the older scheme's id: every dump would pause)
    now = weights.weights_identity(tiny_model)["id"]
    assert store.served_weights_id == now != store.weights_id
    # And another checkpoint is still refused by the fields it recorded
    with pytest.raises(ConfigError, match=r"sampled bytes differ \(compared on the run's "
                                          r"identity scheme shards-v1\)"):
        _store(out, other_model).open()


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
    assert store.weights_id == recorded == store.served_weights_id  # dumps held to the run's
    assert "no *.safetensors weight files" in caplog.text
    # And an identity of another scheme (another hsfarm version) is not a mismatch either
    manifest = json.loads((out / outdir.MANIFEST).read_text())
    manifest["weights"]["scheme"] = "hsfarm-weights-0"
    (out / outdir.MANIFEST).write_text(json.dumps(manifest))
    other_scheme = _store(out, tiny_model).open()
    assert other_scheme.weights_id == recorded
    assert "identity scheme" in caplog.text
    # (its dumps are held to this host's checkpoint, the one identity of this scheme known)
    assert other_scheme.served_weights_id == weights.weights_identity(tiny_model)["id"]


# --- the server's weights against the run's ------------------------------------------------------


def test_a_hook_publishes_what_it_loaded_and_never_raises(
        tiny_model: Path, tmp_path: Path) -> None:
    # Given the model dir a server loaded, and a hub id that is in no cache here
    from engine_dump.checkpoint import loaded_weights, model_config_sha256

    # Then the dir's identity is the farm's, and the config's hash is the file's
    assert loaded_weights(str(tiny_model))["id"] == weights.weights_identity(tiny_model)["id"]
    assert len(model_config_sha256(str(tiny_model))) == 64
    # And an identity that cannot be computed has no shards and says why, raising nothing
    missing = loaded_weights("no-such-org/no-such-model", download_dir=str(tmp_path))
    assert missing["shards"] == [] and "error" in missing
    assert model_config_sha256(str(tmp_path)) == ""
