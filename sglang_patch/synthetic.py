"""A synthetic model for load tests: Kimi-sized hidden states without a model, at a set rate.

No weights and no matmuls: each row is a window of a fixed random bf16 "tape" starting at a
place given by (token id, position), cheap at a GPU host's rate on a CPU, finite, different
per token and position (a chunking or ordering bug shows), and recomputable by a test
(``SyntheticModel.rows``). ``ensure_synthetic_model`` writes the model dir the farm tokenizes
and fingerprints: a Kimi-like ``config.json`` and the tiny model's tokenizer, no weights.
Test: tests/unit/test_synthetic.py::test_values_depend_on_token_and_position_only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from engine_dump.dump_writer import Encode, Staged
from engine_dump.dumpfile import AUX_LAYERS
from engine_dump.fingerprint import default_layers_to_capture
from sglang_patch.reference_model import ChunkOutput
from sglang_patch.tiny_model import ensure_tiny_model

KIMI_HIDDEN_SIZE, KIMI_LAYERS = 7168, 61
VERSION = "v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_TAPE_PERIOD = 4099  # distinct row starts; prime, so (id, position) spread over all of them
_ID_MULT, _POS_MULT = 2_654_435_761, 40_503


def synthetic_model_dir(cache_dir: Path, hidden_size: int, num_layers: int) -> Path:
    return cache_dir / f"synthetic-{VERSION}-h{hidden_size}-l{num_layers}"


def ensure_synthetic_model(cache_dir: Path, hidden_size: int = KIMI_HIDDEN_SIZE,
                           num_layers: int = KIMI_LAYERS) -> Path:
    """Write the model dir once (atomically; safe with concurrent callers). No download."""
    target = synthetic_model_dir(cache_dir, hidden_size, num_layers)
    if (target / "config.json").exists():
        return target
    tiny = ensure_tiny_model(cache_dir)
    tmp = Path(tempfile.mkdtemp(prefix=".synthetic-build.", dir=cache_dir))
    try:
        for name in TOKENIZER_FILES:
            if (tiny / name).exists():
                shutil.copyfile(tiny / name, tmp / name)
        vocab = int(json.loads((tiny / "config.json").read_text())["vocab_size"])
        config = kimi_like_config(hidden_size, num_layers, vocab)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: theirs is identical
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def kimi_like_config(hidden_size: int, num_layers: int, vocab_size: int) -> dict[str, Any]:
    """The fields of Kimi-K2's (DeepSeek-V3 architecture) config that the farm reads."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "vocab_size": vocab_size,
        "max_position_embeddings": 262144,
        "torch_dtype": "bfloat16",
        "hsfarm_synthetic": VERSION,
    }


@dataclass
class _Tapes:
    hidden: torch.Tensor  # [P, H] windows of a bf16 tape (a strided view, no copy)
    aux: torch.Tensor  # [P, 3H]


class SyntheticModel:
    """Duck-types ``ReferenceModel`` for the reference server: same attributes and methods."""

    def __init__(self, model_path: Path, layers_to_capture: tuple[int, ...] | None = None,
                 seed: int = 0) -> None:
        self.model_path = model_path
        raw = (model_path / "config.json").read_bytes()
        cfg = json.loads(raw)
        self.config = SimpleNamespace(model_type=cfg["model_type"],
                                      architectures=cfg["architectures"])
        self.hidden_size = int(cfg["hidden_size"])
        self.num_layers = int(cfg["num_hidden_layers"])
        self.vocab_size = int(cfg["vocab_size"])
        self.context_len = int(cfg["max_position_embeddings"])
        layers = layers_to_capture or default_layers_to_capture(self.num_layers)
        if len(layers) != AUX_LAYERS or not all(0 < i < self.num_layers for i in layers):
            raise ValueError(f"layers_to_capture must be {AUX_LAYERS} ids in "
                             f"1..{self.num_layers - 1}, got {list(layers)}")
        self.layers_to_capture = tuple(layers)
        self.config_sha256 = hashlib.sha256(raw).hexdigest()
        self._tapes = _make_tapes(self.hidden_size, seed)
        self.pool = BufferPool()

    def new_cache(self) -> None:
        return None  # rows depend on (id, position) only: nothing to carry between chunks

    def forward_chunk(self, cache: Any, input_ids: list[int], prefix_len: int) -> ChunkOutput:
        positions = range(prefix_len, prefix_len + len(input_ids))
        hidden, aux = self.rows(input_ids, positions)
        return ChunkOutput(hidden=hidden, aux=aux, next_token=input_ids[-1] % self.vocab_size)

    def forward_batch(self, chunks: list[tuple[list[int], int]]) -> BatchOutput:
        """A whole forward pass at once, into pooled buffers: ``chunks`` = [(ids, prefix)]."""
        ids = [t for chunk, _ in chunks for t in chunk]
        positions = [p for chunk, prefix in chunks for p in range(prefix, prefix + len(chunk))]
        starts = self._starts(ids, positions)
        out = BatchOutput(ids=torch.tensor(ids, dtype=torch.int64),
                          next_tokens=[chunk[-1] % self.vocab_size for chunk, _ in chunks])
        for name, tape in (("hidden", self._tapes.hidden), ("aux", self._tapes.aux)):
            lease = self.pool.take(len(ids), tape.shape[1])
            rows = lease.buf[: len(ids)]
            torch.index_select(tape, 0, starts, out=rows)
            setattr(out, name, rows)
            out.leases.append(lease)
        return out

    def rows(self, ids: list[int],
             positions: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(final [T,H], aux [T,3H]) bf16 for tokens ``ids`` at ``positions``: the values."""
        starts = self._starts(ids, list(positions))
        return self._tapes.hidden[starts], self._tapes.aux[starts]

    @staticmethod
    def _starts(ids: list[int], positions: list[int]) -> torch.Tensor:
        return (torch.tensor(ids, dtype=torch.int64) * _ID_MULT
                + torch.tensor(positions, dtype=torch.int64) * _POS_MULT) % _TAPE_PERIOD


def _make_tapes(hidden_size: int, seed: int) -> _Tapes:
    """Row r of a tape is a window of one random bf16 sequence starting at r (contiguous)."""
    g = torch.Generator().manual_seed(seed)

    def windows(width: int) -> torch.Tensor:
        tape = torch.randn(_TAPE_PERIOD + width, generator=g).to(torch.bfloat16)
        return tape.unfold(0, width, 1)[:_TAPE_PERIOD].contiguous()

    return _Tapes(hidden=windows(hidden_size), aux=windows(AUX_LAYERS * hidden_size))


@dataclass
class BatchOutput:
    ids: torch.Tensor
    next_tokens: list[int]
    hidden: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    aux: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    leases: list[Lease] = field(default_factory=list)


class Lease:
    """One pooled buffer in use. It goes back to the pool when the last holder drops this
    object: the forward pass, then every staged dump part cut from it (``PooledStager``)."""

    def __init__(self, pool: BufferPool, buf: torch.Tensor) -> None:
        self.pool = pool
        self.buf = buf

    def __del__(self) -> None:
        self.pool.give_back(self.buf)


class BufferPool:
    """Reused output buffers. Why: on this kind of VM, faulting in fresh pages costs ~10x the
    copy into them (1.3 vs 17 GB/s), and the load test needs the server's CPU for the farm."""

    def __init__(self, min_rows: int = 8192) -> None:
        self.min_rows = min_rows
        self._free: list[torch.Tensor] = []
        self._leases: dict[int, weakref.ref[Lease]] = {}  # storage address → its lease
        self._lock = threading.Lock()

    def take(self, rows: int, width: int) -> Lease:
        with self._lock:
            i = next((i for i, b in enumerate(self._free)
                      if b.shape[1] == width and b.shape[0] >= rows), None)
            if i is None:
                buf = torch.empty(max(rows, self.min_rows), width, dtype=torch.bfloat16)
            else:
                buf = self._free.pop(i)
            lease = Lease(self, buf)
            self._leases[buf.data_ptr()] = weakref.ref(lease)
            return lease

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._leases.pop(buf.data_ptr(), None)
            self._free.append(buf)

    def lease_of(self, t: torch.Tensor) -> Lease | None:
        """The live lease of the pooled buffer ``t`` is a view of, if any."""
        ref = self._leases.get(t.untyped_storage().data_ptr())
        return ref() if ref is not None else None


@dataclass
class _Held:
    tensors: list[torch.Tensor]
    leases: list[Lease]

    def wait(self) -> list[torch.Tensor]:
        return self.tensors


class PooledStager:
    """The collector's stager for the synthetic model: no copy, since a pooled buffer is not
    reused while a staged part (holding its lease) still points into it."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool

    def stage(self, tensors: list[torch.Tensor], encode: Encode | None = None) -> Staged:
        if encode is not None:  # new tensors (fp8); those still in the pool keep their lease
            tensors = encode(tensors)
        leases = [lease for t in tensors if (lease := self.pool.lease_of(t)) is not None]
        return _Held(list(tensors), leases)
