"""The output store: manifest guard, durable writes, verification from disk, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sglang_patch import contracts as c
from worker.errors import ConfigError, Corrupt
from worker.store import M_CONTENT, OutputStore, Part

H = 4


def _fp(**kw: object) -> c.Fingerprint:
    base: dict[str, object] = dict(
        config_sha256="a", tokenizer_sha256="b", chat_template_sha256="c",
        layers_to_capture=(2, 4, 5), layer_convention=c.LAYER_CONVENTION, hidden_size=H,
        dtype="bfloat16", max_tokens=8192, overlong="reject")
    base.update(kw)
    return c.Fingerprint(**base)  # type: ignore[arg-type]


def _arrays(n: int = 5) -> dict[str, tuple[str, np.ndarray]]:
    rng = np.random.default_rng(n)
    return {
        c.T_INPUT_IDS: ("I64", np.arange(n, dtype=np.int64)),
        c.T_LOSS_MASK: ("I64", np.ones(n, dtype=np.int64)),
        c.T_HIDDEN: ("BF16", rng.integers(0, 0x3F00, (n, H), dtype=np.uint16)),
        c.T_AUX: ("BF16", rng.integers(0, 0x3F00, (n, 3 * H), dtype=np.uint16)),
    }


def _tensors(n: int = 5) -> dict[str, Part]:
    return {k: Part.from_array(dt, a) for k, (dt, a) in _arrays(n).items()}


def test_write_then_verify_from_disk(tmp_path: Path) -> None:
    store = OutputStore(tmp_path, _fp()).open()
    path = store.write("k1", _tensors(), {M_CONTENT: "h1"})
    v = store.verify("k1", "h1")
    assert v.tokens == 5 and v.size_bytes == path.stat().st_size
    assert store.quick_check("k1", "h1") and not store.quick_check("k1", "other")
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert not [p for p in tmp_path.rglob("*") if c.is_temp_name(p.name)]
    # the file is a plain safetensors file that torch loads with the right dtypes
    import torch
    from safetensors.torch import load_file

    t = load_file(str(path))
    assert t[c.T_HIDDEN].dtype == torch.bfloat16 and t[c.T_HIDDEN].shape == (5, H)


def test_one_flipped_byte_is_caught(tmp_path: Path) -> None:
    store = OutputStore(tmp_path, _fp()).open()
    path = store.write("k1", _tensors(), {M_CONTENT: "h1"})
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(Corrupt, match=r"checksum of (aux_)?hidden_state"):
        store.verify("k1", "h1")


def test_truncated_file_is_caught(tmp_path: Path) -> None:
    store = OutputStore(tmp_path, _fp()).open()
    path = store.write("k1", _tensors(), {M_CONTENT: "h1"})
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(Corrupt, match="not a valid safetensors"):
        store.verify("k1", "h1")
    assert not store.quick_check("k1", "h1")


def test_wrong_shapes_are_caught(tmp_path: Path) -> None:
    store = OutputStore(tmp_path, _fp(hidden_size=H + 1)).open()
    store.write("k1", _tensors(), {M_CONTENT: "h1"})
    with pytest.raises(Corrupt, match="hidden_state shape"):
        store.verify("k1", "h1")


def test_output_dir_of_another_run_is_refused(tmp_path: Path) -> None:
    OutputStore(tmp_path, _fp()).open()
    OutputStore(tmp_path, _fp()).open()  # same run: fine
    with pytest.raises(ConfigError, match=r"layers_to_capture: \[2, 4, 6\] != \[2, 4, 5\]"):
        OutputStore(tmp_path, _fp(layers_to_capture=(2, 4, 6))).open()


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    # Given a temp file from a writer that died, one from a live writer and a finished file
    store = OutputStore(tmp_path, _fp()).open()
    store.write("done", _tensors(), {M_CONTENT: "h"})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    host = socket.gethostname()
    shard = store.final_path("x").parent
    shard.mkdir(parents=True, exist_ok=True)
    stale = shard / f".x.safetensors{c.TMP_MARK}{host}.{dead.pid}.abcd1234"
    live = shard / f".y.safetensors{c.TMP_MARK}{host}.{os.getpid()}.abcd1234"
    stale.write_bytes(b"partial")
    live.write_bytes(b"in progress")
    # When cleaning at start-up
    assert store.clean_stale_temp(max_age_s=3600) == 1
    # Then only the dead writer's temp file is gone
    assert not stale.exists() and live.exists()
    store.verify("done", "h")
