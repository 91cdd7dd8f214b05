"""Which record of the data file a source file belongs to: by its ``input_ids`` alone.

Every valid record of DATA is tokenized by this run (its chat template, ``FARM_MAX_TOKENS``,
its overlong policy, the server's limit) and kept as a 128-bit digest of its ids. A source
file belongs to the record whose ids are exactly its own; its name is never read for that.
Records that tokenize to the same ids (a corpus's duplicates) have the same states: the file
belongs to each of them, written once per sample key with that record's own loss mask.
Memory: one digest and one small reference per record; one source file open at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine_dump.dumpfile import AUX_LAYERS, DTYPE_FP8, T_HIDDEN_SCALE, fp8_block_of
from engine_dump.fingerprint import Fingerprint
from producer.adopt.formats import SourceSample, open_sample, readable_entry
from worker.core import finalfile, tensorfile
from worker.core import store as st
from worker.core.errors import BadInput, Corrupt, SourceFileRefused, StaleRecord
from worker.core.samples import SampleRef, read_sample, sample_refs
from worker.server.chat import ChatTokenizer


def ids_digest(ids: np.ndarray | list[int]) -> bytes:
    """128-bit digest of a token sequence (as little-endian int64)."""
    raw = np.ascontiguousarray(np.asarray(ids, dtype="<i8")).tobytes()
    return hashlib.blake2b(raw, digest_size=16).digest()


@dataclass
class Records:
    """DATA's records by the digest of their tokenization (all records with those ids)."""

    by_ids: dict[bytes, list[SampleRef]] = field(default_factory=dict)
    count: int = 0
    invalid: int = 0


def tokenize_records(data: Path, chat: ChatTokenizer, max_record_bytes: int,
                     tick: Callable[[], None] | None = None) -> Records:
    """Tokenize every valid record of ``data`` as a task would (``chat.encode``)."""
    out = Records()
    rejected: list[tuple[str, str]] = []
    for ref in sample_refs(data, max_record_bytes, rejected, []):
        out.count += 1
        if tick is not None:
            tick()
        try:
            sample, _ = read_sample(ref)
            digest = ids_digest(chat.encode(sample).input_ids)
        except (BadInput, StaleRecord):
            out.invalid += 1
            continue
        out.by_ids.setdefault(digest, []).append(ref)
    out.invalid += len(rejected)
    return out


@dataclass
class Scan:
    """Pass 1 over the source: what each file is."""

    matched: dict[str, tuple[Path, SampleRef, int]] = field(default_factory=dict)  # key ->
    done: list[tuple[str, str]] = field(default_factory=list)  # (file, key) already done
    refused: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    # (file, the file read before it with the same ids): its samples are that file's
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    unmatched: int = 0


def check_shapes(s: SourceSample, fp: Fingerprint) -> None:
    """Raises SourceFileRefused when the file's shapes are not this run's."""
    t, h = len(s.input_ids), fp.hidden_size
    problems = []
    if s.hidden.shape[0] != t or s.aux.shape[0] != t:
        problems.append(f"{t} ids but {s.hidden.shape[0]} hidden and {s.aux.shape[0]} aux rows")
    if s.hidden.shape[1] != h:
        problems.append(f"hidden size {s.hidden.shape[1]}, this run's model has {h}")
    if s.aux.shape[1] != AUX_LAYERS * h:
        problems.append(f"aux_hidden_state has {s.aux.shape[1]} columns ({s.aux.shape[1] / h:g}"
                        f" layers of {h}), this run captures {AUX_LAYERS}")
    if s.loss_mask is not None and len(s.loss_mask) != t:
        problems.append(f"loss_mask has {len(s.loss_mask)} entries for {t} ids")
    if t < 2:
        problems.append(f"{t} tokens: trainers need at least 2")
    if s.fp8:
        problems += _fp8_problems(s, fp)
    if problems:
        raise SourceFileRefused("; ".join(problems))


def _fp8_problems(s: SourceSample, fp: Fingerprint) -> list[str]:
    """An fp8 file's problems: a run that stores bf16, scales of neither layout."""
    if fp.dtype != DTYPE_FP8:
        return [f"its states are {DTYPE_FP8} (an fp8 run's), this run stores {fp.dtype}: "
                "states rounded to e4m3 are not taken into a bf16 run; extract them again"]
    assert s.hidden_scale is not None and s.aux_scale is not None
    if s.hidden_scale.ndim != 2 or s.aux_scale.ndim != 2:
        return [f"scales of shapes {list(s.hidden_scale.shape)} and {list(s.aux_scale.shape)}"]
    t, (rows, blocks) = len(s.input_ids), s.hidden_scale.shape
    try:
        fp8_block_of(fp.hidden_size, blocks)
    except ValueError as e:
        return [f"{T_HIDDEN_SCALE}: {e}"]
    if rows != t or s.aux_scale.shape != (t, AUX_LAYERS * blocks):
        return [f"scales of shapes {list(s.hidden_scale.shape)} and {list(s.aux_scale.shape)} "
                f"for {t} tokens and {blocks} blocks a layer"]
    return []


def done_state(store: st.OutputStore, ref: SampleRef) -> str | None:
    """"done" when the run's file of this sample holds this record; a reason when it holds
    another's; None when there is none (or a damaged one, or one not in the run's dtypes and
    shapes: adopting replaces it)."""
    try:
        head = tensorfile.read_header(store.final_path(ref.key))
    except (FileNotFoundError, Corrupt, OSError):
        return None
    meta = head.metadata
    if meta.get(finalfile.M_FINGERPRINT) != store.fingerprint.id:
        return f"the run's file {ref.key} holds a file of another run"
    if meta.get(finalfile.M_CONTENT) != ref.sha256:
        return f"the run's file {ref.key} holds another record"
    return None if store.header_problems(head) else "done"


def scan(files: Iterable[Path], fmt: str, keys: dict[str, tuple[str, ...]] | None,
         records: Records, store: st.OutputStore, source: Path,
         tick: Callable[[], None] | None = None) -> Scan:
    """Open each regular file (ids and shapes only: the states are not read), match it, sort
    it. Entries that are not regular files, or links leaving ``source``, are refused unread."""
    out = Scan()
    first_of: dict[bytes, str] = {}  # ids digest -> the first file read with those ids
    for path in files:
        name = str(path.relative_to(source))
        if tick is not None:
            tick()
        try:
            path = readable_entry(path, source)
            s = open_sample(path, fmt, keys)
            check_shapes(s, store.fingerprint)
            digest = ids_digest(s.input_ids)
        except SourceFileRefused as e:
            out.refused.append((name, str(e)))
            continue
        refs = records.by_ids.get(digest, [])
        if not refs:
            out.unmatched += 1
            out.refused.append((name, f"its {len(s.input_ids)} input_ids match no record of "
                                      "the data file as this run tokenizes it"))
        elif digest in first_of:  # a copy (a corpus's twin records): one file serves them
            out.duplicates.append((name, first_of[digest]))
        else:
            first_of[digest] = name
            for ref in refs:  # records with the same ids: each gets the file
                _sort(out, store, name, path, ref, len(s.input_ids))
    return out


def _sort(out: Scan, store: st.OutputStore, name: str, path: Path, ref: SampleRef,
          tokens: int) -> None:
    """Note ``path`` as done, refused or to adopt for the sample of ``ref``."""
    state = done_state(store, ref)
    if state == "done":
        out.done.append((name, ref.key))
    elif state is not None:
        out.refused.append((name, state))
    else:
        out.matched[ref.key] = (path, ref, tokens)
