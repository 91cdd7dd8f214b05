"""The run's record of its data files (worker/state/corpus.py) against a real Redis: files
known by content as by path, moved files re-pointed, messages resolved to what the run holds
now, and samples parked while their file cannot be read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from worker.core.errors import MalformedMessage, RecordRemoved
from worker.core.samples import SampleRef
from worker.state.corpus import MAX_FORMER_PATHS, Corpus, Identified, readable
from worker.state.index import Registered, RunIndex

RUN = "c" * 16


@pytest.fixture
def corpus(redis_url: str) -> Iterator[Corpus]:
    client = redis.Redis.from_url(redis_url)
    yield Corpus(RunIndex(client, RUN))
    client.close()


def _ref(key: str, fid: int = 0, file: str = "") -> SampleRef:
    return SampleRef(key=key, file=file, offset=0, length=10, sha256="h" * 64, index=0, fid=fid)


def test_a_new_file_gets_a_fid_and_its_content_is_recorded(corpus: Corpus) -> None:
    # When two files are enqueued
    a = corpus.identify("/data/a.jsonl", "sha-a", 100)
    b = corpus.identify("/data/b.jsonl", "sha-b", 200)
    # Then each has its own fid, the same on a second enqueue, with its content and size
    assert a == Identified(1) and b == Identified(2)
    assert corpus.identify("/data/a.jsonl", "sha-a", 100) == Identified(1)
    files = corpus.files()
    assert (files[1].path, files[1].sha256, files[1].size) == ("/data/a.jsonl", "sha-a", 100)
    assert corpus.paths_of(2) == {"/data/b.jsonl"} and corpus.paths_of(9) == set()


def test_a_file_moved_is_the_same_file_at_its_new_path(corpus: Corpus) -> None:
    # Given a file enqueued, then moved (the same content at another path)
    corpus.identify("/data/a.jsonl", "sha-a", 100)
    assert corpus.lookup("/new/a.jsonl", "sha-a") == Identified(1, moved_from="/data/a.jsonl")
    # When it is enqueued from there
    moved = corpus.identify("/new/a.jsonl", "sha-a", 100)
    # Then its fid is kept and re-pointed; a message naming either path resolves to it
    assert moved == Identified(1, moved_from="/data/a.jsonl")
    assert corpus.index.data_files() == {"/new/a.jsonl": 1}
    assert corpus.files()[1].former == ("/data/a.jsonl",)
    assert Corpus.known_paths(corpus.files()) == {"/new/a.jsonl": 1, "/data/a.jsonl": 1}
    # And lookup alone records nothing
    corpus.lookup("/other/a.jsonl", "sha-a")
    assert corpus.index.data_files() == {"/new/a.jsonl": 1}


def test_a_file_moved_many_times_remembers_its_last_paths(corpus: Corpus) -> None:
    for i in range(MAX_FORMER_PATHS + 5):
        corpus.identify(f"/data/{i}.jsonl", "sha-a", 100)
    info = corpus.files()[1]
    assert info.path == f"/data/{MAX_FORMER_PATHS + 4}.jsonl"
    assert len(info.former) == MAX_FORMER_PATHS and "/data/0.jsonl" not in info.former


def test_a_file_moved_and_edited_is_its_predecessor_when_most_of_its_keys_are(
        corpus: Corpus, tmp_path: Path) -> None:
    # Given a file whose samples are registered, then moved away and edited (new content)
    old = tmp_path / "a.jsonl"
    corpus.identify(str(old), "sha-a", 100)
    corpus.index.register({f"k{i}": Registered(1, 10 * i, 10, "h", i) for i in range(4)})
    # When a file whose first records have mostly those keys is enqueued from a new path
    first = ["k0", "k1", "k2", "new"]
    # Then while the old path still exists, it is a new file; once gone, it is the old one
    old.write_text("x")
    assert corpus.predecessor(first) == 0
    old.unlink()
    assert corpus.predecessor(first) == 1
    assert corpus.predecessor(["k0", "x", "y", "z"]) == 0  # a minority is no predecessor
    assert corpus.predecessor(["x"]) == 0
    moved = corpus.identify(str(tmp_path / "b.jsonl"), "sha-b", 120, moved_and_edited=1)
    assert moved == Identified(1, moved_from=str(old))
    assert corpus.files()[1].sha256 == "sha-b"


def test_a_message_resolves_to_the_record_the_run_holds_now(corpus: Corpus) -> None:
    # Given a sample registered in a file that then moved
    corpus.identify("/data/a.jsonl", "sha-a", 100)
    corpus.index.register({"k1": Registered(1, 40, 12, "sha-k1-new", 3)})
    corpus.identify("/new/a.jsonl", "sha-a", 100)
    # When a message published before the move (by path, or by fid) is resolved
    for sent in (_ref("k1", file="/data/a.jsonl"), _ref("k1", fid=1)):
        got = corpus.resolve(sent)
        # Then it reads the file at its new path, at the record's current place and content
        assert (got.file, got.offset, got.length, got.sha256, got.index, got.fid) == (
            "/new/a.jsonl", 40, 12, "sha-k1-new", 3, 1)
    # And a message naming a file that is not the run's, or a sample the run no longer
    # has, is refused with the reason
    with pytest.raises(MalformedMessage):
        corpus.resolve(_ref("k1", file="/etc/passwd"))
    with pytest.raises(RecordRemoved, match="no longer in the run"):
        corpus.resolve(_ref("gone", fid=1))


def test_parked_samples_wait_without_a_message_and_are_taken_once(corpus: Corpus) -> None:
    # Given samples of two files parked because their files cannot be read, one of them
    # running and one retrying before
    corpus.identify("/data/a.jsonl", "sha-a", 100)
    corpus.identify("/data/b.jsonl", "sha-b", 100)
    corpus.index.mark_running("a1", "w1", 1)
    corpus.index.mark_retrying("a2", 1, "server busy")
    for key, fid in (("a1", 1), ("a2", 1), ("b1", 2)):
        corpus.park(_ref(key, fid=fid, file="/data/x"), "Permission denied", "hostA")
    # Then they are parked, no longer running or retrying, and the file is unreadable
    assert corpus.parked() == {"a1": 1, "a2": 1, "b1": 2}
    counts = corpus.index.counts()
    assert (counts.running, counts.retrying, counts.parked) == (0, 0, 3)
    assert corpus.unreadable()[1]["reason"] == "Permission denied"
    assert corpus.unreadable()[1]["host"] == "hostA"
    # When two callers take file 1's samples, Then only the first gets them
    assert sorted(corpus.take_parked(1)) == ["a1", "a2"]
    assert corpus.take_parked(1) == []
    assert corpus.parked() == {"b1": 2}
    # And a caller that could not publish them parks them again
    corpus.repark(["a1"], 1)
    assert corpus.parked() == {"a1": 1, "b1": 2}
    corpus.clear_unreadable(1)
    assert list(corpus.unreadable()) == [2]


def test_a_moved_file_is_readable_again(corpus: Corpus) -> None:
    # Given a file marked unreadable
    corpus.identify("/data/a.jsonl", "sha-a", 100)
    corpus.park(_ref("a1", fid=1, file="/data/a.jsonl"), "No such file", "hostA")
    # When it is enqueued from its new path, Then it is no longer unreadable
    corpus.identify("/new/a.jsonl", "sha-a", 100)
    assert corpus.unreadable() == {}


def test_readable_says_why_a_path_cannot_be_read(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text("[]")
    assert readable(str(f)) is None
    assert readable(str(tmp_path / "missing")) == "No such file or directory"
    assert readable(str(tmp_path)) == "Is a directory"
