"""Streaming the data file into record spans: formats, offsets, broken files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.core.datafile import BOM, DataFileError, FileProblem, Oversized, Span, scan


def _scan(tmp_path: Path, data: bytes) -> list[Span | Oversized | FileProblem]:
    p = tmp_path / "data"
    p.write_bytes(data)
    return list(scan(p))


def test_array_spans_are_exact_bytes_at_their_offsets(tmp_path: Path) -> None:
    # Given an array with strings that contain brackets, commas and escaped quotes
    records = [{"a": "x,]\"}\\"}, {"b": [1, 2, {"c": "[{"}]}, {"id": "ü"}]
    data = json.dumps(records, ensure_ascii=False, indent=2).encode()
    # When scanned
    spans = _scan(tmp_path, data)
    # Then each span is one record, and its offset points at exactly its bytes
    assert [json.loads(s.raw) for s in spans if isinstance(s, Span)] == records
    for s in spans:
        assert isinstance(s, Span)
        assert data[s.offset : s.offset + len(s.raw)] == s.raw


def test_jsonl_spans_and_line_numbers(tmp_path: Path) -> None:
    data = b'{"a": 1}\n\n  {"b": 2}\r\n{"c": 3}'
    spans = _scan(tmp_path, data)
    assert [s.where for s in spans] == ["line 1", "line 3", "line 4"]
    for s in spans:
        assert isinstance(s, Span)
        assert data[s.offset : s.offset + len(s.raw)] == s.raw


def test_bom_is_skipped(tmp_path: Path) -> None:
    spans = _scan(tmp_path, BOM + b'[{"a": 1}]')
    assert len(spans) == 1 and isinstance(spans[0], Span) and spans[0].offset == 4


def test_truncated_array_keeps_complete_records(tmp_path: Path) -> None:
    spans = _scan(tmp_path, b'[{"a": 1}, {"b": 2}, {"c": ')
    assert [s.raw for s in spans if isinstance(s, Span)] == [b'{"a": 1}', b'{"b": 2}']
    problem = spans[-1]
    assert isinstance(problem, FileProblem) and "truncated" in problem.reason


def test_empty_elements_and_trailing_garbage_are_reported(tmp_path: Path) -> None:
    spans = _scan(tmp_path, b'[{"a": 1},,{"b": 2}] trailing')
    problems = [s for s in spans if isinstance(s, FileProblem)]
    assert len([s for s in spans if isinstance(s, Span)]) == 2
    assert any("empty element" in p.reason for p in problems)
    assert any("after the closing" in p.reason for p in problems)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty file"),
    (b"  \n\t ", "empty file"),
    (b'"just a string"', "top level must be"),
    (b"42", "top level must be"),
])
def test_unusable_files_raise(tmp_path: Path, data: bytes, message: str) -> None:
    with pytest.raises(DataFileError, match=message):
        _scan(tmp_path, data)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataFileError, match="No such file"):
        list(scan(tmp_path / "nope.json"))


def test_large_array_streams_in_constant_memory(tmp_path: Path) -> None:
    # Given a file far larger than the scanner's 1 MiB read block
    import tracemalloc

    rec = json.dumps({"messages": [{"role": "user", "content": "x" * 500}]}).encode()
    p = tmp_path / "big.json"
    with open(p, "wb") as f:
        f.write(b"[")
        for i in range(20000):
            f.write((b"," if i else b"") + rec)
        f.write(b"]")
    # When scanned, only counting
    tracemalloc.start()
    n = sum(1 for _ in scan(p))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # Then every record is seen and memory stays far below the file size
    assert n == 20000
    assert p.stat().st_size > 10_000_000 and peak < 4_000_000


@pytest.mark.parametrize("layout", ["jsonl", "array"])
def test_oversized_records_are_marked_not_read(tmp_path: Path, layout: str) -> None:
    # Given a 3 MB record between two small ones
    small = b'{"input_ids": [1, 2]}'
    big = b'{"input_ids": [' + b"7, " * (1 << 20) + b'7]}'
    if layout == "jsonl":
        data = small + b"\n" + big + b"\n" + small + b"\n"
    else:
        data = b"[" + small + b"," + big + b"," + small + b"]"
    p = tmp_path / "data"
    p.write_bytes(data)
    # When scanned with a 64 KB limit
    items = list(scan(p, max_record_bytes=64 << 10))
    # Then the big one is only marked, with its place and size, and the others are intact
    assert [type(x).__name__ for x in items] == ["Span", "Oversized", "Span"]
    over = items[1]
    assert isinstance(over, Oversized) and over.index == 1 and over.length >= len(big)
    assert isinstance(items[2], Span) and items[2].index == 2
    assert data[items[2].offset : items[2].offset + len(small)] == small
