"""Record validation and re-reading records by reference."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from worker.core.errors import BadInput, DataFileUnavailable, MalformedMessage, StaleRecord
from worker.core.samples import SampleRef, content_hash, parse_record, read_sample


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


def test_read_sample_finds_a_moved_record_and_notices_a_changed_one(tmp_path: Path) -> None:
    # Given a record referenced by offset and hash
    raw = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
    p = tmp_path / "d.jsonl"
    p.write_bytes(raw + b"\n")
    ref = SampleRef("k", str(p), 0, len(raw), content_hash(raw), 0)
    assert read_sample(ref)[1] == ref
    # When a record before it grows, the record is found at its new place
    p.write_bytes(b'{"input_ids": [1, 2, 3]}\n' + raw + b"\n")
    sample, moved = read_sample(ref)
    assert moved.offset == 25 and sample.messages[1]["content"] == "a"
    # When the record itself is edited after enqueue, it is stale: no outcome for it
    p.write_bytes(raw.replace(b'"a"', b'"b"') + b"\n")
    with pytest.raises(StaleRecord, match="changed after enqueue"):
        read_sample(ref)
    # And an unreadable file is the environment's fault: the worker waits for it
    p.unlink()
    with pytest.raises(DataFileUnavailable, match="cannot read data file"):
        read_sample(ref)


def test_task_message_is_small_and_round_trips() -> None:
    import orjson

    ref = SampleRef("k" * 96, "/data/" + "d" * 200 + ".json", 10**12, 10**6, "f" * 32, 10**6)
    assert SampleRef.from_json(orjson.loads(orjson.dumps(ref.to_json()))) == ref
    assert len(orjson.dumps(ref.to_json())) < 500
    # enqueue names the data file by its id in the run; the worker resolves it, and only to
    # a data file of the run
    by_id = replace(ref, fid=3)
    sent = SampleRef.from_json(orjson.loads(orjson.dumps(by_id.to_json())))
    assert sent.file == "" and len(orjson.dumps(by_id.to_json())) < 200
    assert sent.resolved({"/x.jsonl": 2, ref.file: 3}) == by_id
    with pytest.raises(MalformedMessage, match="no data file id of this run"):
        sent.resolved({"/x.jsonl": 2})
    with pytest.raises(MalformedMessage, match="not a data file enqueued for this run"):
        ref.resolved({"/x.jsonl": 2})


GOOD = {"k": "ex-1", "f": "/data/x.jsonl", "o": 0, "n": 10, "h": "0" * 32, "i": 0}


@pytest.mark.parametrize(("change", "reason"), [
    ({"k": "../../../models/tiny/model"}, "is not a sample key"),
    ({"k": "a/b"}, "is not a sample key"),
    ({"k": "_hsfarm_canary"}, "one of the farm's own"),
    ({"k": 5}, "field 'k' must be str"),
    ({"f": "relative/x.jsonl"}, "not an absolute file path"),
    ({"h": "../x"}, "32-hex-digit"),
    ({"o": -1}, "out of range"),
    ({"n": 0}, "out of range"),
    ({"n": "10"}, "field 'n' must be int"),
    ({"o": True}, "field 'o' must be int"),
    ({"k": "x" * 20_000_000}, "is not a sample key"),
])
def test_every_field_of_a_task_message_is_checked(change: dict[str, object], reason: str) -> None:
    with pytest.raises(MalformedMessage, match=reason) as e:
        SampleRef.from_json({**GOOD, **change})
    assert len(str(e.value)) < 1000  # a 20 MB field is not repeated in the reason
    with pytest.raises(MalformedMessage, match="field 'h' must be str"):
        SampleRef.from_json({k: v for k, v in GOOD.items() if k != "h"})
    with pytest.raises(MalformedMessage, match="not an object"):
        SampleRef.from_json([GOOD])
