"""The bad-input corpus (tests/support/bad_input/): every kind gets a clear error naming the
record and the reason, while the valid records of the same file go on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine_dump.rids import sample_key_for
from producer.localfarm.farm import LocalFarm
from tests.conftest import FarmFactory, wait_finished
from tests.support.faults import run_hash
from worker.state import keys

CORPUS = Path(__file__).resolve().parents[1] / "support" / "bad_input"


@pytest.fixture(scope="module")
def server_farm(module_farm_factory: FarmFactory) -> LocalFarm:
    return module_farm_factory("bad", chunked_prefill_size=512)


CASES = [
    ("malformed_json.jsonl", 1, 2, ["line 2: malformed JSON"]),
    ("truncated.json", 1, 2, ["truncated file: the top-level array is never closed"]),
    ("wrong_top_level.json", 2, None, ["top level must be a JSON array of samples or JSONL"]),
    ("not_an_object.json", 1, 2, ["record 1: record is int", "record 2: record is str",
                                  "record 3: record is list"]),
    ("missing_or_empty_messages.json", 1, 2, ["record 1: no 'messages'",
                                              "record 2: 'messages' must be a non-empty list",
                                              "record 3: 'messages' must be a non-empty list"]),
    ("unknown_role.json", 1, 2, ["record 1: message 0: unknown role 'wizard'"]),
    ("non_string_content.json", 1, 2, ["record 1: message 0: content must be a string, not list"]),
    ("no_assistant_turn.json", 1, 2, ["record 1: no assistant turn"]),
    ("duplicate_ids.json", 1, 2, ["record 1: duplicate: an earlier record has id 'ok-1'"]),
    ("path_ids.json", 0, 3, ["note, record 0: id '../../etc/passwd' is not usable as a file name",
                             "note, record 2: id '..' is not usable"]),
    ("very_long_id.json", 0, 2, ["note, record 0: id 'LLLL"]),
    ("non_utf8.jsonl", 1, 2, ["line 2: malformed JSON"]),
    ("byte_order_mark.json", 0, 1, []),
    ("empty.json", 2, None, ["empty file, no records"]),
    ("over_max_length.json", 0, 2, []),  # the worker rejects it: see the test below
]


@pytest.mark.parametrize(("name", "rc", "published", "messages"), CASES)
def test_each_kind_of_bad_input(server_farm: LocalFarm, name: str, rc: int,
                                published: int | None, messages: list[str]) -> None:
    res = server_farm.cli("enqueue", str(CORPUS / name), "--dry-run", "--no-progress")
    out = res.stdout + res.stderr
    assert res.returncode == rc, out
    if published is not None:
        assert f"published: {published}\n" in out, out
    for m in messages:
        assert m in out, out


def test_worker_side_rejections_and_safe_paths(tmp_path: Path,
                                               farm_factory: FarmFactory) -> None:
    farm = farm_factory(chunked_prefill_size=512, env={"FARM_MAX_TOKENS": "512"})
    # Given a file with an over-long sample, one with hostile ids, and one that will be
    # edited after it is enqueued
    changing = tmp_path / "changing.jsonl"
    rec = {"id": "edit-me", "messages": [{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "a"}]}
    changing.write_text(json.dumps(rec) + "\n")
    for f in (CORPUS / "over_max_length.json", CORPUS / "path_ids.json", changing):
        assert farm.cli("enqueue", str(f), "--no-progress").returncode == 0
    changing.write_text(json.dumps({**rec, "messages": rec["messages"][::-1]}) + "\n")
    # When the worker runs
    farm.start_worker("w1", concurrency=2)
    wait_finished(farm, 5)
    # Then each problem is recorded with its record and reason, and the rest is done; the
    # edited record is stale (no outcome: re-running enqueue would publish its new content)
    rejected = {k: json.loads(v) for k, v in run_hash(farm, keys.REJECTED).items()}
    assert "over the maximum of 512" in rejected["long"]["reason"]
    assert rejected["long"]["record"] == "record 1"
    stale = {k: json.loads(v) for k, v in run_hash(farm, keys.STALE).items()}
    assert list(stale) == ["edit-me"] and "changed after enqueue" in stale["edit-me"]["reason"]
    status = farm.cli("status", "--failures").stdout
    assert re.search(r"rejected +long: sample has \d+ tokens", status)
    # and hostile ids made files only inside the output dir, with safe names
    safe = [sample_key_for(i, "") for i in ["../../etc/passwd", "a/b\\c", ".."]]
    names = sorted(p.name for p in (farm.output_dir / "samples").rglob("*.safetensors"))
    assert names == sorted(f"{k}.safetensors" for k in ["ok-1", *safe])
    audit = farm.cli("audit", "--data", str(CORPUS / "path_ids.json"))
    assert audit.returncode == 0 and "whole: 3 " in audit.stdout, audit.stdout
    # the edited record is what audit now reports missing: it was never extracted
    audit = farm.cli("audit")
    assert audit.returncode == 1 and "missing edit-me" in audit.stdout
    for p in (farm.output_dir / "samples").rglob("*"):
        assert p.resolve().is_relative_to(farm.output_dir.resolve())
        if p.is_file():
            assert p.stat().st_mode & 0o002 == 0  # not world-writable
