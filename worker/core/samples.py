"""One training sample: what a record in the data file may look like, and how it is checked.

Records are OpenAI ``messages`` (or ``conversations``), ShareGPT ``{"from", "value"}``
messages, or pre-tokenized ``input_ids`` with an optional ``loss_mask`` (docs/input.md). The
task message carries a ``SampleRef`` (file, byte span, content hash; ``sample_refs`` makes
them), never the sample: the worker re-reads the record and notices a change since enqueue.
Test: tests/unit/test_samples.py::
test_read_sample_finds_a_moved_record_and_notices_a_changed_one."""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from engine_dump.rids import is_user_sample_key, sample_key_for
from worker.core.datafile import FileProblem, Oversized, Span, scan
from worker.core.errors import BadInput, DataFileUnavailable, MalformedMessage, StaleRecord

ROLE_ALIASES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
}


@dataclass(frozen=True)
class Sample:
    """A validated record: either messages, or pre-tokenized ids."""

    source_id: object
    messages: tuple[dict[str, str], ...] = ()
    input_ids: tuple[int, ...] = ()
    loss_mask: tuple[int, ...] = ()


_HASH_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class SampleRef:
    """Where a sample lives: small enough for a task message (well under 1 KB).

    The data file goes in a message by its id in the run (``d``, from ``enqueue``), or by
    its path (``f``: ``audit --requeue``, and messages that carry no id); either way the
    worker accepts only a data file registered for the run.
    """

    key: str
    file: str  # "" until resolved from ``fid``
    offset: int
    length: int
    sha256: str
    index: int
    fid: int = 0  # the data file's id in the run; 0: not known

    def to_json(self) -> dict[str, Any]:
        where: dict[str, Any] = {"d": self.fid} if self.fid else {"f": self.file}
        return {"k": self.key, **where, "o": self.offset, "n": self.length,
                "h": self.sha256, "i": self.index}

    def resolved(self, files: dict[str, int]) -> SampleRef:
        """This ref with its data file's path, checked against the run's data files
        (path -> id). Raises MalformedMessage for a file that is not one of them."""
        if self.fid:
            path = next((p for p, fid in files.items() if fid == self.fid), None)
            if path is None:
                raise MalformedMessage(f"d: {self.fid} is no data file id of this run")
            return replace(self, file=path)
        if self.file not in files:
            raise MalformedMessage(f"f: {self.file[:200]!r} is not a data file enqueued for "
                                   "this run")
        return self

    @classmethod
    def from_json(cls, d: Any) -> SampleRef:
        """Parse and check every field of an (untrusted) task message.

        Raises:
            MalformedMessage: a field is missing, of the wrong type or out of range; the
                message names the field and holds at most a bounded part of its value.
        """
        if not isinstance(d, dict):
            raise MalformedMessage(f"task message is {type(d).__name__}, not an object")
        key, sha = (_field(d, name, str) for name in ("k", "h"))
        offset, length, index = (_field(d, name, int) for name in ("o", "n", "i"))
        fid = _field(d, "d", int) if "d" in d else 0
        file = "" if "d" in d else _field(d, "f", str)
        problems = []
        if not is_user_sample_key(key):
            problems.append(f"k: {key[:100]!r} is not a sample key (or one of the farm's own)")
        if "d" in d and fid < 1:
            problems.append(f"d: {fid} is not a data file id")
        if "d" not in d and (not os.path.isabs(file) or "\0" in file or len(file) > 4096):
            problems.append(f"f: {file[:200]!r} is not an absolute file path")
        if not _HASH_RE.match(sha):
            problems.append(f"h: {sha[:100]!r} is not a 32-hex-digit content hash")
        if offset < 0 or length < 1 or index < 0:
            problems.append(f"o/n/i out of range: {offset}/{length}/{index}")
        if problems:
            raise MalformedMessage("malformed task message: " + "; ".join(problems))
        return cls(key=key, file=file, offset=offset, length=length, sha256=sha, index=index,
                   fid=fid)


def _field(d: dict[str, Any], name: str, kind: type) -> Any:
    value = d.get(name)
    if type(value) is not kind:  # bool is not an int here, and no coercion from strings
        raise MalformedMessage(f"malformed task message: field {name!r} must be "
                               f"{kind.__name__}, got {type(value).__name__}")
    return value


def content_hash(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:32]


def parse_record(raw: bytes, prompts: bool = False) -> Sample:
    """Parse and validate one record's bytes (``prompts``: as ``validate_record``).

    Raises:
        BadInput: with a reason a person can act on.
    """
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadInput(f"malformed JSON: {e}") from e
    return validate_record(obj, prompts)


def validate_record(obj: Any, prompts: bool = False) -> Sample:
    """Check a decoded record and normalise it. Raises BadInput.

    ``prompts``: a regenerating run's (docs/regeneration.md), whose records may hold no
    assistant turn: the served model's replies are generated."""
    if not isinstance(obj, dict):
        raise BadInput(f"record is {type(obj).__name__}, expected a JSON object")
    source_id = obj.get("id")
    if source_id is not None and not isinstance(source_id, str | int):
        raise BadInput(f"id must be a string or an integer, not {type(source_id).__name__}")
    if "input_ids" in obj:
        return _pretokenized(obj, source_id)
    field = next((f for f in ("messages", "conversations") if f in obj), None)
    if field is None:
        raise BadInput("no 'messages', 'conversations' or 'input_ids' field")
    msgs = obj[field]
    if not isinstance(msgs, list) or not msgs:
        raise BadInput("'messages' must be a non-empty list")
    messages = tuple(_message(m, i) for i, m in enumerate(msgs))
    if not prompts and not any(m["role"] == "assistant" for m in messages):
        raise BadInput("no assistant turn: nothing to train the drafter on (a prompt-only "
                       "record is for a run with FARM_REGENERATE=1: docs/regeneration.md)")
    return Sample(source_id=source_id, messages=messages)


def _message(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict):
        raise BadInput(f"message {i} is {type(m).__name__}, expected an object")
    role = m.get("role", m.get("from"))
    content = m.get("content", m.get("value"))
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise BadInput(f"message {i}: unknown role {role!r} (expected one of "
                       f"{', '.join(sorted(ROLE_ALIASES))})")
    if not isinstance(content, str):
        raise BadInput(f"message {i}: content must be a string, not {type(content).__name__}")
    return {"role": ROLE_ALIASES[role.lower()], "content": content}


def _pretokenized(obj: dict[str, Any], source_id: object) -> Sample:
    ids, mask = obj["input_ids"], obj.get("loss_mask")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise BadInput("input_ids must be a non-empty list of non-negative integers")
    if mask is None:
        mask = [1] * len(ids)
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(x in (0, 1) for x in mask):
        raise BadInput(f"loss_mask must be a list of 0/1 of the same length as input_ids "
                       f"({len(ids)})")
    if not any(mask):
        raise BadInput("loss_mask is all zero: nothing to train the drafter on")
    return Sample(source_id=source_id, input_ids=tuple(ids), loss_mask=tuple(mask))


def read_sample(ref: SampleRef, prompts: bool = False) -> tuple[Sample, SampleRef]:
    """Re-read a record from its data file, checking it is the one enqueued; a record whose bytes
    moved is found again by its content hash, and the returned ref says where it is now
    (``prompts``: a regenerating run's, ``validate_record``).

    Raises:
        DataFileUnavailable: the file cannot be read (the environment's fault: wait for it).
        StaleRecord: the record is no longer in the file as it was enqueued.
        BadInput: the record's content is invalid.
    """
    raw = _read_span(ref.file, ref.offset, ref.length)
    if len(raw) != ref.length or content_hash(raw) != ref.sha256:
        found = _LOCATOR.find(ref.file, ref.sha256)
        if found is None:
            raise StaleRecord(
                f"record {ref.index} of {ref.file} changed after enqueue: no record with "
                f"content hash {ref.sha256} is in the file now; re-run enqueue on it")
        ref = replace(ref, offset=found[0], length=found[1])
        raw = _read_span(ref.file, ref.offset, ref.length)
        if content_hash(raw) != ref.sha256:
            raise StaleRecord(f"{ref.file} is changing while it is read; re-run enqueue")
    return parse_record(raw, prompts), ref


def _read_span(path: str, offset: int, length: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return os.pread(f.fileno(), length, offset)
    except OSError as e:
        raise DataFileUnavailable(f"cannot read data file {path}: {e.strerror}") from e


class _Locator:
    """Per process: content hash -> (offset, length) of every record of a file version.

    Built on first need for a (path, size, mtime) and kept, so one edit near the top of a
    large file costs each worker process one scan, not one per record.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, tuple[tuple[int, int], dict[str, tuple[int, int]]]] = {}

    def find(self, path: str, sha256: str) -> tuple[int, int] | None:
        try:
            st = os.stat(path)
        except OSError as e:
            raise DataFileUnavailable(f"cannot read data file {path}: {e.strerror}") from e
        version = (st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = self._files.get(path)
            if cached is None or cached[0] != version:
                cached = (version, {content_hash(s.raw): (s.offset, len(s.raw))
                                    for s in scan(Path(path)) if isinstance(s, Span)})
                self._files[path] = cached
        return cached[1].get(sha256)


_LOCATOR = _Locator()


def key_digest(key: str) -> int:
    """A sample key's 64-bit digest: what enqueue keeps per record of a file."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def sample_refs(path: Path, max_record_bytes: int, rejected: list[tuple[str, str]],
                problems: list[tuple[str, str]], limit: int | None = None,
                progress: Callable[[int], None] | None = None,
                notes: list[tuple[str, str]] | None = None,
                prompts: bool = False) -> Iterator[SampleRef]:
    """The valid records of ``path`` as task references, in file order (``prompts``: a
    regenerating run's, ``validate_record``).

    Invalid or oversized records go to ``rejected`` and broken stretches of the file to
    ``problems``, each as (where, reason); a record whose key repeats an earlier record's is
    rejected as a duplicate.
    """
    seen: set[int] = set()
    abs_path = str(path.resolve())
    count = 0
    for item in scan(path, max_record_bytes):
        if isinstance(item, FileProblem):
            problems.append((item.where, item.reason))
            continue
        if limit is not None and count >= limit:
            return
        count += 1
        if progress is not None:
            progress(item.offset + item.length if isinstance(item, Oversized)
                     else item.offset + len(item.raw))
        size = item.length if isinstance(item, Oversized) else len(item.raw)
        if isinstance(item, Oversized) or size > max_record_bytes:
            rejected.append((item.where, f"record is {size} bytes, over FARM_MAX_RECORD_BYTES "
                                         f"({max_record_bytes}); split it or raise the limit"))
            continue
        sha = content_hash(item.raw)
        try:
            sample = parse_record(item.raw, prompts)
        except BadInput as e:
            rejected.append((item.where, str(e)))
            continue
        key = sample_key_for(sample.source_id, sha)
        digest = key_digest(key)
        if digest in seen:
            what = (f"id {sample.source_id!r}" if sample.source_id is not None
                    else "the same content")
            rejected.append((item.where, f"duplicate: an earlier record has {what} (sample key "
                                         f"{key})"))
            continue
        seen.add(digest)
        if notes is not None and sample.source_id is not None and key != sample.source_id:
            notes.append((item.where, f"id {str(sample.source_id)[:60]!r} is not usable as a "
                                      f"file name; its sample key is {key!r}"))
        yield SampleRef(key=key, file=abs_path, offset=item.offset, length=len(item.raw),
                        sha256=sha, index=item.index)
