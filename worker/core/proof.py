"""The per-sample proof: the server's own prompt logprobs, recomputed from the stored final state.

Row ``r`` of the final state is the LM head's input at position ``r``: ``log_softmax(W · h_r)
[ids[r+1]]`` must equal the server's logprob of token ``r+1``, asked in the same request (no
determinism needed). The LM head is memory-mapped read-only (the page cache's one copy per
host) and widened a chunk at a time; numpy only. Per row the bound is ``atol + rel · (|x_t| +
E_p|x|)``: ``rel`` the rounding of the logits (bf16) and of the stored state (docs/proof.md).
The aux layers are not covered (the canary's). Test: tests/unit/test_proof.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine_dump import header_codec
from engine_dump.dumpfile import DTYPE_BF16, DTYPE_FP8, T_HIDDEN, T_HIDDEN_SCALE
from worker.core import fp8, tensorfile
from worker.core.errors import ConfigError

# (atol, rel) per stored dtype: what a correct capture's rows stay under (docs/proof.md)
TOLERANCE = {DTYPE_BF16: (1e-4, 2.0 ** -6), DTYPE_FP8: (0.01, 2.0 ** -3)}
CHUNK_BYTES = 64 << 20  # float32 bytes of LM-head rows widened at once
_HEAD_DTYPES: dict[str, np.dtype[Any]] = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"),
                                          "F32": np.dtype("<f4")}
_HEAD_RE = re.compile(r"^(?:.*\.)?lm_head\.weight$")
_EMBED_RE = re.compile(r"^(?:.*\.)?(?:embed_tokens|wte|word_embeddings)\.weight$")
# tensors beside a quantized head: compressed-tensors, GPTQ/AWQ, fp8 block scales
_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_scale_inv", "qweight", "scales",
                   "weight_zero_point", "g_idx")


class ProofUnavailable(ConfigError):
    """The checkpoint's LM head cannot be read as a plain matrix (quantized, absent): the run
    goes on without the proof, and says why."""


@dataclass(frozen=True)
class LmHead:
    """The checkpoint's LM head, memory-mapped: ``rows`` [V, H] as stored (bf16 as uint16)."""

    name: str
    dtype: str  # "BF16", "F16" or "F32"
    rows: np.ndarray

    @property
    def vocab_size(self) -> int:
        return int(self.rows.shape[0])

    def widened(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as float32 (bf16 widened exactly)."""
        part = self.rows[start:stop]
        if self.dtype == "BF16":  # bf16 bits as the high half of each float32: one copy
            wide = np.zeros(part.shape, dtype=np.uint32)
            wide.view(np.uint16)[:, 1::2] = part
            return wide.view(np.float32)
        return part.astype(np.float32)


def _read_config(model_dir: Path) -> dict[str, object]:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ProofUnavailable(f"{model_dir}/config.json cannot be read: {e}") from e
    text = config.get("text_config") if isinstance(config, dict) else None
    return {**config, **text} if isinstance(text, dict) else dict(config)


def _weight_map(model_dir: Path) -> dict[str, str]:
    index = model_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        single = model_dir / "model.safetensors"
        with open(single, "rb") as f:
            entries, _ = header_codec.decode(f.read(header_codec.length(f.read(8))))
        return dict.fromkeys(entries, "model.safetensors")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ProofUnavailable(f"{model_dir}: no readable safetensors index ({e})") from e


def pick_lm_head(names: list[str], tied: bool) -> str:
    """The LM head's tensor name: ``…lm_head.weight`` (the shortest, outside MTP/draft
    blocks), or the token embedding when the config ties them.

    Raises:
        ProofUnavailable: none, or a quantized one (its scales or packed weight beside it).
    """
    heads = sorted((n for n in names if _HEAD_RE.match(n) and "mtp" not in n), key=len)
    if not heads:
        quantized = [n for n in names if ".lm_head." in f".{n}"]
        if quantized:
            raise ProofUnavailable(f"the LM head is quantized ({', '.join(quantized[:3])}): "
                                   "the proof needs it unquantized; the run goes on without it")
        embeds = sorted((n for n in names if _EMBED_RE.match(n)), key=len)
        if tied and embeds:
            return embeds[0]
        raise ProofUnavailable("the checkpoint has no lm_head.weight"
                               + ("" if tied else " and does not tie it to the embedding"))
    stem = heads[0][: -len("weight")]
    scales = [f"{stem}{s}" for s in _QUANT_SUFFIXES if f"{stem}{s}" in names]
    if scales:
        raise ProofUnavailable(f"the LM head {heads[0]} is quantized ({', '.join(scales)} "
                               "beside it): the proof needs it unquantized; the run goes on "
                               "without it")
    return heads[0]


def open_lm_head(model_dir: Path, hidden_size: int) -> LmHead:
    """Map the checkpoint's LM head read-only, without reading it.

    Raises:
        ProofUnavailable: no readable, unquantized [V, hidden_size] head in the checkpoint.
    """
    config = _read_config(model_dir)
    weight_map = _weight_map(model_dir)
    name = pick_lm_head(sorted(weight_map), bool(config.get("tie_word_embeddings", False)))
    shard = model_dir / weight_map[name]
    try:
        with open(shard, "rb") as f:
            length = header_codec.length(f.read(8))
            entries, _ = header_codec.decode(f.read(length))
    except (OSError, ValueError) as e:
        raise ProofUnavailable(f"{shard}: cannot read its header ({e})") from e
    entry = entries[name]
    dtype, shape = str(entry["dtype"]), [int(x) for x in entry["shape"]]
    if dtype not in _HEAD_DTYPES or len(shape) != 2 or shape[1] != hidden_size:
        raise ProofUnavailable(f"{shard}: {name} is {dtype}{shape}, not a BF16/F16/F32 "
                               f"[V, {hidden_size}] matrix (quantized?): the run goes on "
                               "without the proof")
    begin = int(entry["data_offsets"][0])
    rows: np.ndarray = np.memmap(shard, dtype=_HEAD_DTYPES[dtype], mode="r",
                                 offset=8 + length + begin, shape=(shape[0], shape[1]))
    return LmHead(name, dtype, rows)


def chosen(key: str, rate: float) -> bool:
    """Whether sample ``key`` is proven at ``rate`` (0..1): the same answer on every attempt,
    so that a retry of a sample whose proof failed is proven again."""
    if rate >= 1.0:
        return True
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") < rate * 2.0 ** 64


def pick_rows(n: int, k: int, seed: str) -> np.ndarray:
    """``k`` rows of ``0..n-2`` (a row predicts the next token: the last one has none to
    check), one drawn in each of ``k`` equal strata, so they spread over the whole sequence
    and differ between samples. All of them when there are no more than ``k``."""
    m = n - 1
    if m <= k:
        return np.arange(max(m, 0), dtype=np.int64)
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8],
                                               "big"))
    edges = np.linspace(0, m, k + 1)
    lo, hi = np.ceil(edges[:-1]).astype(np.int64), np.ceil(edges[1:]).astype(np.int64)
    return np.unique(lo + (rng.random(k) * np.maximum(hi - lo, 1)).astype(np.int64))


def read_rows(fd: int, header: tensorfile.Header, rows: np.ndarray) -> np.ndarray:
    """The final state's ``rows`` as float32 [k, H], from a dump or a final file's descriptor:
    bf16 widened, or fp8 dequantized with its block scales (``fp8.dequantize``)."""
    e = header.tensors[T_HIDDEN]
    width = e.shape[1]
    item = tensorfile.numpy_dtype(e.dtype).itemsize
    raw = np.stack([np.frombuffer(pread(fd, width * item, header.data_start + e.begin
                                         + int(r) * width * item),
                                  dtype=tensorfile.numpy_dtype(e.dtype)) for r in rows])
    if e.dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    s = header.tensors[T_HIDDEN_SCALE]
    per = s.shape[1]
    scales = np.stack([np.frombuffer(pread(fd, per * 4, header.data_start + s.begin
                                            + int(r) * per * 4), dtype="<f4") for r in rows])
    return fp8.dequantize(raw, scales, layers=1)


def pread(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset`` of ``fd``. Raises OSError on a short read."""
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise OSError(f"short read: {len(data)} of {size} bytes at {offset}")
    return data


@dataclass(frozen=True)
class Recomputed:
    """Per row: the token's logprob from float32 logits and from bf16-rounded ones (the
    engine's, when it runs the model in bf16), and the scale the tolerance grows with."""

    logprob: np.ndarray  # float64 [k]
    logprob_bf16: np.ndarray  # float64 [k]
    magnitude: np.ndarray  # float64 [k]: |x_t| + E_p|x|


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.astype(np.uint32).view(np.float32)


class _Softmax:
    """A running log-sum-exp over chunks of logits, with the token's logit and E_p|x|."""

    def __init__(self, k: int) -> None:
        self.peak = np.full(k, -np.inf)
        self.total, self.weighted_abs, self.target = np.zeros(k), np.zeros(k), np.zeros(k)

    def add(self, logits: np.ndarray, targets: np.ndarray, start: int) -> None:
        peak = np.maximum(self.peak, logits.max(axis=1))
        fade = np.exp(self.peak - peak)
        p = np.exp(logits - peak[:, None])
        self.total = self.total * fade + p.sum(axis=1)
        self.weighted_abs = self.weighted_abs * fade + (p * np.abs(logits)).sum(axis=1)
        self.peak = peak
        inside = (targets >= start) & (targets < start + logits.shape[1])
        self.target[inside] = logits[inside, targets[inside] - start]

    def logprob(self) -> np.ndarray:
        return self.target - (self.peak + np.log(self.total))

    def magnitude(self) -> np.ndarray:
        return np.abs(self.target) + self.weighted_abs / self.total


def recompute(head: LmHead, hidden: np.ndarray, targets: np.ndarray,
              chunk_bytes: int = CHUNK_BYTES) -> Recomputed:
    """``log_softmax(hidden · Wᵀ)[targets]`` per row, in one pass over the head's rows (a
    running log-sum-exp), widening ``chunk_bytes`` of them to float32 at a time.

    Twice: from the float32 logits, and from them rounded to bf16, as an engine running the
    model in bf16 rounds them before its float32 softmax (SGLang's and vLLM's logits
    processors): the same rounding gives the same numbers, to float32's."""
    k, h = hidden.shape
    hidden = np.ascontiguousarray(hidden, dtype=np.float32)
    step = max(1, chunk_bytes // (4 * h))
    plain, rounded = _Softmax(k), _Softmax(k)
    for start in range(0, head.vocab_size, step):
        logits = hidden @ head.widened(start, min(start + step, head.vocab_size)).T
        plain.add(logits.astype(np.float64), targets, start)
        rounded.add(round_bf16(logits).astype(np.float64), targets, start)
    return Recomputed(plain.logprob(), rounded.logprob(), plain.magnitude())


@dataclass(frozen=True)
class Verdict:
    """The proof of one sample: its checked rows, and how far the worst was from its bound."""

    rows: int
    worst_row: int  # -1: no row checked
    worst_error: float
    worst_allowed: float
    failed: tuple[int, ...]  # the rows over their bound

    @property
    def ok(self) -> bool:
        return not self.failed

    def describe(self) -> str:
        if self.worst_row < 0:
            return "no row to check"
        return (f"{len(self.failed)} of {self.rows} rows off (worst: row {self.worst_row}, "
                f"|Δ logprob| {self.worst_error:.3g} > {self.worst_allowed:.3g})"
                if self.failed else
                f"{self.rows} rows agree (worst |Δ logprob| {self.worst_error:.3g}, bound "
                f"{self.worst_allowed:.3g})")


def compare(rows: np.ndarray, ours: Recomputed, server: np.ndarray, dtype: str,
            slack: float = 0.0) -> Verdict:
    """Each row's recomputed logprob against the server's (``server[i]`` for ``rows[i]``),
    within ``TOLERANCE[dtype]``, plus ``slack`` (another forward pass than the stored one's:
    ``audit --prove``)."""
    if not len(rows):
        return Verdict(0, -1, 0.0, 0.0, ())
    atol, rel = TOLERANCE[dtype]
    error = np.fmin(np.abs(ours.logprob - server), np.abs(ours.logprob_bf16 - server))
    allowed = atol + slack + rel * ours.magnitude
    over = ~(error <= allowed)  # NaN counts as over
    worst = int(np.nanargmax(error / allowed)) if not np.isnan(error).all() else 0
    return Verdict(len(rows), int(rows[worst]), float(error[worst]), float(allowed[worst]),
                   tuple(int(r) for r in rows[over]))


def prove(head: LmHead, hidden: np.ndarray, rows: np.ndarray, input_ids: np.ndarray,
          server_logprobs: np.ndarray, dtype: str, slack: float = 0.0) -> Verdict:
    """The proof of one sample: ``hidden`` [k, H] are its final state's ``rows``;
    ``server_logprobs[j]`` the server's logprob of ``input_ids[j]`` (position 0 unused)."""
    targets = input_ids[rows + 1]
    return compare(rows, recompute(head, hidden, targets), server_logprobs[rows + 1], dtype,
                   slack)
