"""Stream a data file's records as byte spans, in constant memory.

A JSON array (``[``) or JSONL (``{``), told apart by the first non-blank byte. Each record comes
out as its exact bytes, offset and length, so a task can point at it and the worker re-read and
hash-check it; one over ``max_record_bytes`` comes out as ``Oversized``, never read. The array
scanner tracks only nesting and string state (no JSON library yields byte offsets); each record
is parsed on its own, so a malformed one is rejected and the rest go on.
Test: tests/unit/test_datafile.py::test_large_array_streams_in_constant_memory."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

BOM = b"\xef\xbb\xbf"
_CHUNK = 1 << 20
_WS = frozenset(b" \t\r\n")
_STRUCT = re.compile(rb'[\\"{}\[\],]')


@dataclass(frozen=True)
class Span:
    """One record's bytes; ``where`` names it for people ("line 7" / "record 7")."""

    index: int
    offset: int
    raw: bytes
    where: str


@dataclass(frozen=True)
class Oversized:
    """A record too large to take: where it is and about how large (never read)."""

    index: int
    offset: int
    length: int
    where: str


@dataclass(frozen=True)
class FileProblem:
    """A problem with the file as a whole or a stretch of it (not one parseable record)."""

    where: str
    reason: str


class DataFileError(Exception):
    """The file cannot be read as records at all (missing, empty, wrong top-level type)."""


Item = Span | Oversized | FileProblem


def file_sha256(path: Path) -> str:
    """The sha256 of the whole file (32 hex digits): how a run knows a data file by its
    content, wherever it is moved (worker/state/corpus.py).

    Raises:
        DataFileError: the file cannot be read.
    """
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(_CHUNK * 4):
                h.update(block)
    except OSError as e:
        raise DataFileError(f"{path}: {e.strerror}") from e
    return h.hexdigest()[:32]


def scan(path: Path, max_record_bytes: int = 1 << 62) -> Iterator[Item]:
    """Yield every record span, oversized records, and problems where the structure is broken.

    Raises:
        DataFileError: the file is missing, empty, or neither a JSON array nor JSONL.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed by the with below)
    except OSError as e:
        raise DataFileError(f"{path}: {e.strerror}") from e
    with f:
        head = f.read(_CHUNK)
        start = len(BOM) if head.startswith(BOM) else 0
        first = next((i for i in range(start, len(head)) if head[i] not in _WS), None)
        while first is None and len(head) == _CHUNK:  # a long run of blanks
            more = f.read(_CHUNK)
            if not more:
                break
            head += more
            first = next((i for i in range(start, len(head)) if head[i] not in _WS), None)
        if first is None:
            raise DataFileError(f"{path}: empty file, no records")
        f.seek(0)
        kind = head[first : first + 1]
        if kind == b"[":
            yield from _scan_array(f, first + 1, max_record_bytes)
        elif kind == b"{":
            yield from _scan_jsonl(f, start, max_record_bytes)
        else:
            shown = head[first : first + 20].decode("utf-8", "replace")
            raise DataFileError(
                f"{path}: top level must be a JSON array of samples or JSONL (one object per "
                f"line); it starts with {shown!r}"
            )


def _scan_jsonl(f: BinaryIO, start: int, max_bytes: int) -> Iterator[Item]:
    f.seek(start)
    offset, index, lineno = start, 0, 0
    while True:
        line = f.readline(max_bytes + 2)  # room for "\r\n": a line of max_bytes still fits
        if not line:
            return
        lineno += 1
        if len(line) == max_bytes + 2 and not line.endswith(b"\n"):
            length = len(line) + _skip_rest_of_line(f)
            yield Oversized(index, offset, length, f"line {lineno}")
            index += 1
            offset += length
            continue
        body = line.rstrip(b"\r\n")
        if body.strip():
            lead = len(body) - len(body.lstrip())
            yield Span(index, offset + lead, body.strip(), f"line {lineno}")
            index += 1
        offset += len(line)


def _skip_rest_of_line(f: BinaryIO) -> int:
    """Read past the end of the current line in bounded chunks; how many bytes were skipped."""
    skipped = 0
    while True:
        chunk = f.readline(_CHUNK)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def _scan_array(f: BinaryIO, pos: int, max_bytes: int) -> Iterator[Item]:
    """Split a top-level array into element spans by tracking depth and strings.

    Only structural bytes are visited (a regex finds them), so the loop runs per quote or
    bracket, not per byte; the element bytes are then read back with ``pread``.
    """
    fd = f.fileno()
    f.seek(pos)
    depth, in_str, skip_to = 0, False, -1
    elem_from, index, offset = pos, 0, pos
    while True:
        block = f.read(_CHUNK)
        if not block:
            break
        for m in _STRUCT.finditer(block):
            at = offset + m.start()
            b = block[m.start()]
            if at < skip_to:
                continue  # the character after a backslash
            if in_str:
                if b == 0x5C:
                    skip_to = at + 2
                elif b == 0x22:
                    in_str = False
            elif b == 0x22:
                in_str = True
            elif b in (0x7B, 0x5B):
                depth += 1
            elif b in (0x7D, 0x5D) and depth > 0:
                depth -= 1
            elif depth == 0 and b in (0x2C, 0x5D):  # ',' or ']' at top level
                span = _span(fd, index, elem_from, at, max_bytes)
                if span is not None:
                    yield span
                    index += 1
                elif b == 0x2C:
                    yield FileProblem(f"record {index} (byte {at})", "empty element (',,')")
                if b == 0x5D:
                    if os.pread(fd, 1 << 16, at + 1).strip():
                        yield FileProblem(f"after record {index - 1}",
                                          "data after the closing ']' is ignored")
                    return
                elem_from = at + 1
        offset += len(block)
    where = f"after record {index - 1}" if index else "at the start"
    yield FileProblem(where, "truncated file: the top-level array is never closed; "
                             f"the {offset - elem_from} bytes after it do not form a record")


def _span(fd: int, index: int, start: int, end: int, max_bytes: int) -> Span | Oversized | None:
    if end - start > max_bytes + 64:  # (leading/trailing blanks allowed around a record)
        return Oversized(index, start, end - start, f"record {index}")
    raw = os.pread(fd, end - start, start)
    body = raw.strip()
    if not body:
        return None
    lead = len(raw) - len(raw.lstrip())
    return Span(index, start + lead, body, f"record {index}")
