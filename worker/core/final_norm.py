"""The model's final-norm weight, read without torch, and kept beside the manifest.

Our ``hidden_state`` is after the final RMSNorm; vLLM's speculators wants it before. RMSNorm is
scale-invariant, so ``hidden_state / w`` is a pre-norm state that the trainer's norm maps back,
to bf16 rounding: the run keeps ``w``'s exact bytes in ``<out>/final_norm.safetensors``. ``w`` is
the ``…norm.weight`` (or ``ln_f``, ``final_layernorm``, ``norm_f``) of shape [H] outside any
layer, vision tower or MTP block whose prefix is the LM head's (``pick_final_norm``).
Test: tests/unit/test_training.py::test_final_norm_is_found_in_nested_and_other_checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine_dump import header_codec
from worker.core import durable, outdir, tensorfile
from worker.core.errors import ConfigError

TENSOR = "weight"
M_SOURCE_NAME, M_CONFIG_SHA, M_EPS = "source_tensor", "model_config_sha256", "rms_norm_eps"

_FINAL_NORM_RE = re.compile(r"^(?P<prefix>(?:.*?\.)?)(?:model\.)?"
                            r"(?:norm|ln_f|final_layernorm|norm_f)\.weight$")
_NOT_FINAL_RE = re.compile(r"(^|\.)(layers|h|blocks|encoder\.layer)\.\d+\.|vision|visual|"
                           r"mm_projector|multi_modal|audio|mtp")
_SHARD_DTYPES = {"BF16", "F32"}


@dataclass(frozen=True)
class FinalNorm:
    """The weight (raw bytes as a tensorfile.Tensor) and where it came from."""

    source_name: str
    weight: tensorfile.Tensor
    rms_norm_eps: float
    config_sha256: str

    def as_float32(self) -> np.ndarray:
        """The weight as float32 values (bf16 widened exactly)."""
        arr = self.weight.array
        if self.weight.dtype == "BF16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr.astype(np.float32)


def _weight_map(model_dir: Path) -> dict[str, str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{index}: no readable weight_map ({e})") from e
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"{model_dir} has neither model.safetensors.index.json nor "
                          "model.safetensors: cannot read the final-norm weight")
    return dict.fromkeys(_header(single), "model.safetensors")


def _header(path: Path) -> dict[str, dict[str, object]]:
    """The safetensors header of ``path`` (names → dtype, shape, offsets), without data."""
    with open(path, "rb") as f:
        entries, _ = header_codec.decode(f.read(header_codec.length(f.read(8))))
    return entries


def _prefix(name: str) -> str:
    m = _FINAL_NORM_RE.match(name)
    return m["prefix"] if m else ""


def pick_final_norm(names: list[str]) -> str:
    """The final-norm tensor's name among a checkpoint's tensor names.

    Raises:
        ConfigError: none, or several that the LM head's prefix does not tell apart.
    """
    found = [n for n in names if _FINAL_NORM_RE.match(n) and not _NOT_FINAL_RE.search(n)]
    if len(found) > 1:
        heads = [n[: -len("lm_head.weight")] for n in names if n.endswith("lm_head.weight")]
        found = [n for n in found if _prefix(n) in heads] or found
    if len(found) != 1:
        raise ConfigError(f"cannot tell the model's final norm weight: candidates "
                          f"{found or 'none'} (expected one '...norm.weight' outside the layers)")
    return found[0]


def read_final_norm(model_dir: Path, hidden_size: int) -> FinalNorm:
    """Read the final-norm weight's exact bytes from the model's shards. Raises ConfigError."""
    weight_map = _weight_map(model_dir)
    name = pick_final_norm(sorted(weight_map))
    shard = model_dir / weight_map[name]
    entry = _header(shard)[name]
    dtype, shape = str(entry["dtype"]), list(entry["shape"])  # type: ignore[call-overload]
    if dtype not in _SHARD_DTYPES or shape != [hidden_size]:
        raise ConfigError(f"{shard}: {name} is {dtype}{shape}, expected BF16/F32 [{hidden_size}]")
    offsets: list[int] = list(entry["data_offsets"])  # type: ignore[call-overload]
    start, end = offsets
    with open(shard, "rb") as f:
        f.seek(8 + header_codec.length(f.read(8)) + start)
        raw = f.read(end - start)
    np_dtype = np.dtype("<u2") if dtype == "BF16" else np.dtype("<f4")
    config_bytes = (model_dir / "config.json").read_bytes()
    config = json.loads(config_bytes)
    eps = float(config.get("text_config", config).get("rms_norm_eps", 1e-6))
    return FinalNorm(name, tensorfile.Tensor(dtype, np.frombuffer(raw, np_dtype).copy()), eps,
                     hashlib.sha256(config_bytes).hexdigest())


def write_final_norm(out_dir: Path, norm: FinalNorm, checksums: dict[str, str]) -> Path:
    """``<out>/final_norm.safetensors``, temp → fsync → link → fsync(dir)
    (first writer wins; same bytes).

    ``checksums``: metadata entries holding the weight's checksum, as the store writes them.
    """
    path = out_dir / outdir.FINAL_NORM_FILE
    if path.exists():
        return path
    tmp = outdir.temp_path(path)
    meta = {M_SOURCE_NAME: norm.source_name, M_CONFIG_SHA: norm.config_sha256,
            M_EPS: repr(norm.rms_norm_eps), **checksums}
    try:
        tensorfile.write(tmp, {TENSOR: norm.weight}, meta)
        os.chmod(tmp, 0o644)
        durable.commit_new(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_final_norm(out_dir: Path) -> FinalNorm:
    """Read ``<out>/final_norm.safetensors``. Raises FileNotFoundError or Corrupt."""
    tf = tensorfile.read(out_dir / outdir.FINAL_NORM_FILE)
    m = tf.metadata
    return FinalNorm(m.get(M_SOURCE_NAME, ""), tf.tensors[TENSOR], float(m.get(M_EPS, "1e-6")),
                     m.get(M_CONFIG_SHA, ""))
