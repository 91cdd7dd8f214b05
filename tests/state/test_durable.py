"""Every file the farm puts in place is on the device before it takes its name, and its name is
on the device before the writer goes on: temp file → fsync → rename → fsync(dir)
(worker/core/durable.py). Real files; which paths ``os.fsync`` was called on is recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from producer.localfarm.farm import LocalFarm
from worker.core import durable
from worker.state import hosts, keys


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The paths ``os.fsync`` is called on, in order (read from /proc at the call)."""
    paths: list[Path] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        paths.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return paths


def _file_then_dir(synced: list[Path], final: Path) -> None:
    """``final``'s bytes were synced (under a temp name beside it), then its directory."""
    files = [i for i, p in enumerate(synced)
             if p.parent == final.parent and p.name.startswith(f".{final.name}")]
    dirs = [i for i, p in enumerate(synced) if p == final.parent]
    assert files and dirs and files[-1] < dirs[-1], synced


def test_a_durable_write_syncs_the_file_before_its_rename_then_the_directory(
        tmp_path: Path, synced: list[Path]) -> None:
    # Given a file that exists, when it is written again durably
    final = tmp_path / "a.json"
    final.write_text("old")
    durable.write_json(final, {"b": 1, "a": [2]})
    # then it holds the new content, no temp file is left, and file then dir were synced
    assert json.loads(final.read_text()) == {"a": [2], "b": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    _file_then_dir(synced, final)


def test_forget_hosts_writes_hosts_json_durably(tmp_path: Path, synced: list[Path]) -> None:
    # Given an output dir that knows two hosts
    (tmp_path / "hosts.json").write_text(json.dumps({"a": {}, "b": {}}))
    # when one is forgotten
    hosts.forget_hosts(tmp_path, ["a"])
    # then hosts.json says so, and was synced before and after its rename
    assert hosts.read_known(tmp_path) == {"b": {}}
    _file_then_dir(synced, tmp_path / "hosts.json")


def test_remember_hosts_writes_hosts_json_durably(
        tmp_path: Path, redis_server: LocalFarm, redis_url: str, synced: list[Path]) -> None:
    # Given a run whose Redis (the tier's, emptied) knows a host this output dir has not recorded
    r, out = redis_server.redis(), tmp_path / "out"
    out.mkdir()
    r.hset(keys.run_key("0123456789abcdef", keys.HOSTS), "h1",
           json.dumps({"output_dir": "/x", "root_id": "r1"}))
    # when the dir remembers the run's hosts
    hosts.remember_hosts(r, "0123456789abcdef", out)
    # then hosts.json names it, and was synced before and after its rename
    assert hosts.read_known(out) == {"h1": {"output_dir": "/x", "root_id": "r1"}}
    _file_then_dir(synced, out / "hosts.json")


def test_the_root_id_is_written_durably(tmp_path: Path, synced: list[Path]) -> None:
    # Given an output dir without a root id, when a host reads it
    first = hosts.root_id(tmp_path)
    # then it was made under a temp name, synced before it took its name, then its directory;
    # no temp file is left, and it reads the same again
    _file_then_dir(synced, tmp_path / ".hsfarm-root-id")
    assert [p.name for p in tmp_path.iterdir()] == [".hsfarm-root-id"]
    assert hosts.root_id(tmp_path) == first
