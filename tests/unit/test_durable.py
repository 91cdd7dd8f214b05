"""Durable writes and moves (worker/core/durable.py) on real files: what each leaves behind, and
which directories it syncs. The fsync order of a commit: tests/state/test_durable.py."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from engine_dump.dumpfile import is_temp_name
from worker.core import diskio, durable, outdir, setaside, tensorfile
from worker.core.finalfile import M_CONTENT


@pytest.fixture
def synced_dirs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The directories ``diskio.fsync_dir`` is called on, in order."""
    dirs: list[Path] = []
    real = diskio.fsync_dir

    def fsync_dir(path: Path) -> None:
        dirs.append(path)
        real(path)

    monkeypatch.setattr(diskio, "fsync_dir", fsync_dir)
    return dirs


def test_a_commit_leaves_the_final_file_and_no_temp(tmp_path: Path) -> None:
    # Given a temp file named as every writer names one, beside a final file that exists
    final = tmp_path / "a.bin"
    final.write_bytes(b"old")
    tmp = outdir.temp_path(final)
    assert is_temp_name(tmp.name) and not is_temp_name(final.name)
    tmp.write_bytes(b"new")
    # When it is committed
    durable.commit(tmp, final)
    # Then the final file reads back the new bytes, and no temp file is left
    assert final.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


def test_a_synced_temp_file_commits_without_a_second_fsync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, synced_dirs: list[Path]) -> None:
    # Given a temp file its writer already synced
    final = tmp_path / "a.bin"
    tmp = outdir.temp_path(final)
    tmp.write_bytes(b"data")
    files: list[Path] = []
    monkeypatch.setattr(diskio, "fsync_file", files.append)
    # When it is committed as synced
    durable.commit_synced(tmp, final)
    # Then it takes its name, the directory is synced, and the file is not synced again
    assert final.read_bytes() == b"data" and not tmp.exists()
    assert synced_dirs == [tmp_path] and files == []


def test_the_first_new_file_wins_and_no_temp_is_left(tmp_path: Path) -> None:
    # Given no file yet, when two writers write it in turn
    final = tmp_path / ".id"
    assert durable.write_new_bytes(final, b"first")
    assert not durable.write_new_json(final, {"second": 1})
    # Then the first writer's bytes stay, and neither left a temp file
    assert final.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == [".id"]


def test_a_move_renames_and_syncs_both_directories(
        tmp_path: Path, synced_dirs: list[Path]) -> None:
    # Given a file in one directory and another directory
    src, dest = tmp_path / "a" / "f", tmp_path / "b" / "f"
    src.parent.mkdir()
    dest.parent.mkdir()
    src.write_bytes(b"kept")
    # When it is moved durably
    durable.move(src, dest)
    # Then it is only at its new name, and both directories were synced
    assert dest.read_bytes() == b"kept" and not src.exists()
    assert synced_dirs == [dest.parent, src.parent]


def test_a_removal_syncs_the_directory(tmp_path: Path, synced_dirs: list[Path]) -> None:
    # Given a file
    path = tmp_path / "f"
    path.write_bytes(b"x")
    # When it is removed durably, and removed again with missing_ok
    durable.remove(path)
    durable.remove(path, missing_ok=True)
    # Then it is gone and its directory was synced each time; without missing_ok it raises
    assert not path.exists() and synced_dirs == [tmp_path, tmp_path]
    with pytest.raises(FileNotFoundError):
        durable.remove(path)


def test_a_final_file_set_aside_moves_durably(tmp_path: Path, synced_dirs: list[Path]) -> None:
    # Given a sample's final file holding its content hash
    final = outdir.final_path(tmp_path, "k1")
    final.parent.mkdir(parents=True)
    tensorfile.write(final, {"x": tensorfile.Tensor("I64", np.zeros(2, np.int64))},
                     {M_CONTENT: "abc"})
    # When it is set aside
    dest = setaside.set_aside(tmp_path, "k1")
    # Then it is kept under removed/ by its content hash, both directories synced
    assert dest == outdir.removed_path(tmp_path, "k1", "abc") and dest.is_file()
    assert not final.exists() and synced_dirs == [dest.parent, final.parent]
    assert setaside.removed_by_key(tmp_path) == {"k1": [dest]}


def test_cache_drops_and_advice_take_an_fd_or_a_path(tmp_path: Path) -> None:
    # Given a synced file
    path = tmp_path / "f"
    path.write_bytes(b"y" * 8192)
    diskio.fsync_file(path)
    diskio.fsync_dir(tmp_path)
    fds = len(os.listdir("/proc/self/fd"))
    # When its pages are dropped by path, by fd, and read-ahead is advised
    diskio.drop_cache(path)
    with open(path, "rb") as f:
        diskio.drop_cache(f.fileno())
    diskio.advise(path, os.POSIX_FADV_WILLNEED)
    # Then its bytes are unchanged and no descriptor is left open
    assert path.read_bytes() == b"y" * 8192
    assert len(os.listdir("/proc/self/fd")) == fds
