"""Record validation and re-reading records by reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.errors import BadInput
from worker.samples import SampleRef, content_hash, parse_record, read_sample


def test_openai_sharegpt_and_pretokenized_records() -> None:
    a = parse_record(b'{"id": "x", "messages": [{"role": "user", "content": "hi"},'
                     b'{"role": "assistant", "content": "yo"}]}')
    b = parse_record(b'{"conversations": [{"from": "human", "value": "hi"},'
                     b'{"from": "gpt", "value": "yo"}]}')
    assert a.messages == b.messages
    assert a.source_id == "x" and b.source_id is None
    p = parse_record(b'{"id": 3, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}')
    assert p.input_ids == (1, 2, 3) and p.loss_mask == (0, 1, 1)
    assert parse_record(b'{"input_ids": [5, 6]}').loss_mask == (1, 1)


@pytest.mark.parametrize(("raw", "reason"), [
    (b'{"messages": [', "malformed JSON"),
    (b"[1, 2]", "record is list"),
    (b'"text"', "record is str"),
    (b'{"id": "x"}', "no 'messages'"),
    (b'{"messages": []}', "non-empty list"),
    (b'{"messages": "hi"}', "non-empty list"),
    (b'{"messages": [1]}', "message 0 is int"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "unknown role 'wizard'"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "content must be a string"),
    (b'{"messages": [{"role": "user", "content": "q"}]}', "no assistant turn"),
    (b'{"id": {"a": 1}, "messages": []}', "id must be"),
    (b'{"input_ids": []}', "non-empty list"),
    (b'{"input_ids": [1, -2]}', "non-negative"),
    (b'{"input_ids": [1, 2], "loss_mask": [1]}', "same length"),
    (b'{"input_ids": [1, 2], "loss_mask": [0, 0]}', "all zero"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "malformed JSON"),
])
def test_bad_records_get_specific_reasons(raw: bytes, reason: str) -> None:
    with pytest.raises(BadInput, match=reason):
        parse_record(raw)


def test_read_sample_notices_a_changed_file(tmp_path: Path) -> None:
    # Given a record referenced by offset and hash
    raw = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
    p = tmp_path / "d.jsonl"
    p.write_bytes(raw + b"\n")
    ref = SampleRef("k", str(p), 0, len(raw), content_hash(raw), 0)
    assert read_sample(ref)[1] == raw
    # When the file is edited after enqueue
    p.write_bytes(raw.replace(b'"a"', b'"b"') + b"\n")
    # Then the worker refuses it as changed
    with pytest.raises(BadInput, match="changed since enqueue"):
        read_sample(ref)
    p.unlink()
    with pytest.raises(BadInput, match="cannot read data file"):
        read_sample(ref)


def test_task_message_is_small_and_round_trips() -> None:
    import orjson

    ref = SampleRef("k" * 96, "/data/" + "d" * 200 + ".json", 10**12, 10**6, "f" * 32, 10**6)
    assert SampleRef.from_json(orjson.loads(orjson.dumps(ref.to_json()))) == ref
    assert len(orjson.dumps(ref.to_json())) < 500
    with pytest.raises(BadInput, match="malformed task message"):
        SampleRef.from_json({"k": "x"})
