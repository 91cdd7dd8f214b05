"""One training sample: what a record in the data file may look like, and how it is checked.

Accepted record shapes (JSON objects):
- ``{"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}`` (OpenAI), or the same
  under ``"conversations"``;
- ShareGPT messages ``{"from": "human"|"gpt"|"system", "value": "..."}`` in either list;
- pre-tokenized ``{"id": ..., "input_ids": [...], "loss_mask": [...]?}`` (mask defaults to 1s).

The task message never carries the sample: it carries a ``SampleRef`` (file, byte span, content
hash) and the worker re-reads the record, noticing if the file changed since it was enqueued.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from worker.errors import BadInput

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


@dataclass(frozen=True)
class SampleRef:
    """Where a sample lives: small enough for a task message (well under 1 KB)."""

    key: str
    file: str
    offset: int
    length: int
    sha256: str
    index: int

    def to_json(self) -> dict[str, Any]:
        return {"k": self.key, "f": self.file, "o": self.offset, "n": self.length,
                "h": self.sha256, "i": self.index}

    @classmethod
    def from_json(cls, d: Any) -> SampleRef:
        try:
            return cls(key=str(d["k"]), file=str(d["f"]), offset=int(d["o"]),
                       length=int(d["n"]), sha256=str(d["h"]), index=int(d["i"]))
        except (TypeError, KeyError, ValueError) as e:
            raise BadInput(f"malformed task message {d!r}: {e}") from e


def content_hash(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:32]


def parse_record(raw: bytes) -> Sample:
    """Parse and validate one record's bytes.

    Raises:
        BadInput: with a reason a person can act on.
    """
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadInput(f"malformed JSON: {e}") from e
    return validate_record(obj)


def validate_record(obj: Any) -> Sample:
    """Check a decoded record and normalise it. Raises BadInput."""
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
    if not any(m["role"] == "assistant" for m in messages):
        raise BadInput("no assistant turn: nothing to train the drafter on")
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


def read_sample(ref: SampleRef) -> tuple[Sample, bytes]:
    """Re-read a record from its data file by byte span, checking it did not change.

    Raises:
        BadInput: the file is gone, or the bytes there are no longer the record enqueued.
    """
    try:
        with open(Path(ref.file), "rb") as f:
            f.seek(ref.offset)
            raw = f.read(ref.length)
    except OSError as e:
        raise BadInput(f"cannot read data file {ref.file}: {e.strerror}") from e
    if len(raw) != ref.length or content_hash(raw) != ref.sha256:
        raise BadInput(
            f"data file changed since enqueue: record {ref.index} at byte {ref.offset} no longer "
            f"has content hash {ref.sha256}; re-run enqueue on the new file"
        )
    return parse_record(raw), raw
