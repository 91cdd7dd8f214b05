"""Copies of the tiny model that differ from it in one specific, small way."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

EMBEDDING = "model.embed_tokens.weight"


def bos_row_changed(base: Path, out: Path, delta: float = 0.5) -> Path:
    """``base`` with only the embedding row of its BOS token changed, in place, every other byte
    of the shard the same: a change no plain-text prompt reaches, and one that falls between
    the sampled ranges of the weights identity's quick check."""
    shutil.copytree(base, out, ignore=shutil.ignore_patterns(".hsfarm-*"))
    bos = int(json.loads((out / "config.json").read_text())["bos_token_id"])
    shard = out / "model.safetensors"
    with open(shard, "r+b") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(header_len))[EMBEDDING]
        assert entry["dtype"] == "F32", entry
        width = int(entry["shape"][1])
        at = 8 + header_len + int(entry["data_offsets"][0]) + bos * width * 4
        f.seek(at)
        row = np.frombuffer(f.read(width * 4), dtype="<f4") + np.float32(delta)
        f.seek(at)
        f.write(row.astype("<f4").tobytes())
    return out
