"""Canary hidden states: what the run's model computed for a few fixed prompts, and the test
that the server still computes it.

The first worker records three conversations tokenized as samples are (BOS, template tokens,
system, user and assistant turns) in ``<out>/canary.safetensors``, linked into place so one of
several starting workers wins; every worker re-sends the recorded ids (an older recording's of
plain text too) and compares per layer within ``FARM_CANARY_*_REL_ERR`` (docs/canary.md).
Test: tests/unit/test_canary.py::test_recording_is_written_once_and_read_back."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine_dump.dumpfile import M_LAYERS, M_SERVER_VERSION
from engine_dump.fingerprint import Fingerprint
from worker.core import checksums, diskio, durable, outdir, tensorfile
from worker.core.errors import ConfigError, Corrupt, Transient
from worker.core.finalfile import M_WEIGHTS_ID

ROWS_PER_PROMPT = 48  # tokens sampled per prompt (plus the chunk boundary): small files
LONG_CAP_TOKENS = 16384
_TEXT = ("Hidden states are the activations of a model. Speculative decoding drafts tokens "
         "with a small model and verifies them with a large one. The quick brown fox jumps "
         "over the lazy dog; le renard brun saute par-dessus le chien paresseux. ")
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."
ANSWER = "Hidden states feed the draft model; the target model checks its tokens."
M_LAYERS_NAMES = "layer_names"
M_PROMPTS = "prompts_form"  # how the prompts were tokenized; absent: plain text (older hsfarm)
PROMPTS_CHAT = "chat-template"
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Canary:
    """One prompt's token ids and the hidden states of some of its rows.

    ``states``: float32 [4, R, H] (the three aux layers in order, then the final), bf16 values.
    """

    input_ids: np.ndarray  # int64 [T]
    rows: np.ndarray  # int64 [R]
    states: np.ndarray


def prompt_texts() -> list[str]:
    """Short, medium, long (the long one is cut to its token length by ``prompt_ids``)."""
    return [_TEXT.split(";")[0], _TEXT * 3, _TEXT * 400]


def prompt_conversations() -> list[Messages]:
    """Each text as a sample's conversation: a system prompt, the text as the user's turn, an
    assistant's answer. The long one is cut inside its user turn, after the template's
    leading tokens."""
    return [[{"role": "system", "content": SYSTEM_PROMPT},
             {"role": "user", "content": text},
             {"role": "assistant", "content": ANSWER}] for text in prompt_texts()]


def long_tokens(chunk_size: int, max_tokens: int) -> int:
    """The long prompt's length: past one chunk of a chunked-prefill server, within limits."""
    want = chunk_size + 64 if chunk_size > 0 else 1024
    return max(2, min(want, max_tokens, LONG_CAP_TOKENS))


def prompt_ids(encode: Callable[[Messages], list[int]], chunk_size: int,
               max_tokens: int) -> list[list[int]]:
    """The canary prompts as token ids (``encode(messages) -> ids``: the run's tokenizer and
    chat template, as samples are tokenized)."""
    short, medium, long = (list(encode(m)) for m in prompt_conversations())
    limit = min(max_tokens, LONG_CAP_TOKENS)
    return [short[:limit], medium[:limit], long[: long_tokens(chunk_size, max_tokens)]]


def sample_rows(n_tokens: int, chunk_size: int) -> np.ndarray:
    """Which rows are kept: evenly spaced ones (the first and last included) and the two
    rows either side of the first chunk boundary, where a chunking bug would show."""
    if n_tokens <= ROWS_PER_PROMPT:
        return np.arange(n_tokens, dtype=np.int64)
    rows = set(np.linspace(0, n_tokens - 1, ROWS_PER_PROMPT).round().astype(int).tolist())
    if 0 < chunk_size < n_tokens:
        rows |= {chunk_size - 1, chunk_size}
    return np.array(sorted(rows), dtype=np.int64)


def layer_names(layers_to_capture: tuple[int, ...]) -> list[str]:
    return [f"aux layer {i}" for i in layers_to_capture] + ["final"]


# --- the recording ---------------------------------------------------------------------------

def path_in(out_dir: Path) -> Path:
    return out_dir / outdir.CANARY_FILE


def record(out_dir: Path, canaries: list[Canary], meta: dict[str, str]) -> bool:
    """Write the recording durably unless one exists; True if this call wrote it.

    Raises:
        Transient: an I/O error (the caller waits and tries again).
        Corrupt: what was written does not read back the same.
    """
    path = path_in(out_dir)
    tensors = {}
    for i, cn in enumerate(canaries):
        tensors[f"c{i}.input_ids"] = tensorfile.Tensor("I64", cn.input_ids.astype(np.int64))
        tensors[f"c{i}.rows"] = tensorfile.Tensor("I64", cn.rows.astype(np.int64))
        tensors[f"c{i}.states"] = tensorfile.Tensor("BF16", _to_bf16(cn.states))
    sums = {k: checksums.tensor_checksum(np.ascontiguousarray(t.array).data)
            for k, t in tensors.items()}
    body = {**meta, "prompts": str(len(canaries)), **checksums.checksum_metadata(sums)}
    tmp = outdir.temp_path(path)
    try:
        tensorfile.write(tmp, tensors, body)
        won = durable.commit_new(tmp, path)  # of several workers starting at once, one wins
    except OSError as e:
        raise Transient(f"writing {path}: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    load(out_dir)  # read back from the device, checksums compared
    return won


def load(out_dir: Path) -> tuple[list[Canary], dict[str, str]]:
    """The recorded canaries and their metadata, read from the device and checked.

    Raises:
        FileNotFoundError: nothing recorded yet.
        ConfigError: the recording is damaged (a person decides what to do).
    """
    path = path_in(out_dir)
    diskio.drop_cache(path)
    try:
        tf = tensorfile.read(path)
        _, want = checksums.file_checksums(tf.metadata)
        bad = [k for k, t in tf.tensors.items()
               if want.get(k) != checksums.tensor_checksum(np.ascontiguousarray(t.array).data)]
        if bad or set(want) != set(tf.tensors):
            raise Corrupt(f"checksums of {sorted(bad) or 'the tensor set'} differ")
        n = int(tf.metadata["prompts"])
        out = [Canary(tf.tensors[f"c{i}.input_ids"].array, tf.tensors[f"c{i}.rows"].array,
                      from_bf16(tf.tensors[f"c{i}.states"].array)) for i in range(n)]
    except (Corrupt, KeyError, ValueError) as e:
        raise ConfigError(
            f"{path} is damaged ({e}): restore it from a copy; remove it only if the server "
            "certainly serves the run's model (the next worker records it anew)") from e
    return out, tf.metadata


def _to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 holding bf16 values → their bf16 bit patterns (uint16), exactly."""
    return (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) → float32 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# --- the comparison --------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerError:
    name: str
    max_rel: float
    mean_rel: float


@dataclass(frozen=True)
class Comparison:
    layers: list[LayerError]
    problems: list[str]  # what is wrong beyond the numbers (ids, layer set)
    max_rel_tol: float
    mean_rel_tol: float

    @property
    def passed(self) -> bool:
        return not self.problems and all(
            e.max_rel <= self.max_rel_tol and e.mean_rel <= self.mean_rel_tol
            for e in self.layers)

    def table(self) -> str:
        """Per layer: max and mean relative error, and whether each is within tolerance."""
        lines = [f"  {'layer':<16} {'max rel err':>12} {'mean rel err':>13}   "
                 f"(tolerance: max {self.max_rel_tol:.2%}, mean {self.mean_rel_tol:.2%})"]
        for e in self.layers:
            flag = "" if e.max_rel <= self.max_rel_tol and e.mean_rel <= self.mean_rel_tol \
                else "   <-- differs"
            lines.append(f"  {e.name:<16} {e.max_rel:>12.4%} {e.mean_rel:>13.4%}{flag}")
        return "\n".join(lines + [f"  {p}" for p in self.problems])

    def summary(self) -> str:
        worst = max(self.layers, key=lambda e: e.max_rel / max(self.max_rel_tol, 1e-12),
                    default=None)
        head = "; ".join(self.problems)
        if worst is None:
            return head
        nums = f"worst {worst.name}: max rel err {worst.max_rel:.3%}, mean {worst.mean_rel:.3%}"
        return f"{head}; {nums}" if head else nums


def relative_errors(new: np.ndarray, recorded: np.ndarray) -> np.ndarray:
    """Per token (row): L2 of the difference over L2 of the recorded row. [.., R, H] → [.., R]"""
    diff = np.linalg.norm(new.astype(np.float64) - recorded, axis=-1)
    base = np.linalg.norm(recorded.astype(np.float64), axis=-1)
    return diff / np.maximum(base, 1e-30)


def compare(recorded: list[Canary], new: list[np.ndarray], names: list[str],
            max_rel_tol: float, mean_rel_tol: float,
            problems: list[str] | None = None) -> Comparison:
    """Compare re-extracted states (``new[i]``: [4, R_i, H] at ``recorded[i].rows``)."""
    errs = [relative_errors(n, r.states) for n, r in zip(new, recorded, strict=True)]
    per_layer = np.concatenate(errs, axis=1) if errs else np.zeros((len(names), 0))
    layers = [LayerError(name, float(per_layer[i].max(initial=0.0)),
                         float(per_layer[i].mean()) if per_layer.shape[1] else 0.0)
              for i, name in enumerate(names)]
    return Comparison(layers, list(problems or []), max_rel_tol, mean_rel_tol)


def recording_meta(fingerprint: Fingerprint, weights_id: str, server_version: str,
                   chunk_size: int) -> dict[str, str]:
    return {"fingerprint_id": fingerprint.id, M_WEIGHTS_ID: weights_id, M_PROMPTS: PROMPTS_CHAT,
            M_LAYERS: json.dumps(list(fingerprint.layers_to_capture)),
            M_LAYERS_NAMES: json.dumps(layer_names(fingerprint.layers_to_capture)),
            M_SERVER_VERSION: server_version, "chunked_prefill_size": str(chunk_size),
            "recorded_at": str(time.time()), "recorded_by": socket.gethostname()}
