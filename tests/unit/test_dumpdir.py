"""The dump dir's files are its users' alone: dumps, errors and markers are private, and a dump
that is a link or another user's file, or a dump dir put in place of the checked one, is never
read or written, nor is one made again by another user with the old inode number (a disk file
system), or one whose path goes through another user's link. Files, and ``nobody`` (setpriv) as
the other user (root only: ``as_root``); no server or worker.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from engine_dump import dumpdir
from engine_dump.dump_writer import DumpWriter, Failed, Rows, _Done
from engine_dump.dumpfile import M_CONFIG_SHA, M_LAYERS, dump_path, err_path
from engine_dump.markers import write_ready_marker
from tests.support.dumpdir import AS_NOBODY, NOBODY, as_root
from tests.support.dumpdir import disk_sticky as disk_sticky  # a fixture
from tests.support.dumpdir import shm_dir as shm_dir  # a fixture
from tests.support.dumpdir import shm_parent as shm_parent  # a fixture
from worker.core import dumps as worker_dumps
from worker.core.errors import ConfigError
from worker.core.settings import Settings
from worker.server.fingerprint import compute_fingerprint


def _write_dump(d: Path, rid: str, n: int = 4, h: int = 8, config_sha256: str = "") -> Path:
    writer = DumpWriter(d, {M_LAYERS: "[2, 4, 5]", M_CONFIG_SHA: config_sha256},
                        min_free_bytes=0)
    try:
        writer.submit(_rows(rid, n, h))
        writer.submit(Failed(rid + "x", "a test error"))
        writer.flush()
    finally:
        writer.close()
    return dump_path(d, rid)


def _rows(rid: str, n: int = 4, h: int = 8) -> list[Rows]:
    """A whole request of ``n`` tokens, as the hook hands it to the dump writer."""
    return [Rows(rid, 0, n, _Done([torch.arange(n), torch.randn(n, h), torch.randn(n, 3 * h)]))]


@as_root
@pytest.mark.parametrize("shared", [False, True])
def test_dumps_errors_and_markers_are_readable_by_the_dump_dirs_users_only(
        shm_dir: Path, shared: bool) -> None:
    # Given a dump dir made by the server (0700), or a group dir shared with the workers (2770)
    if shared:
        shm_dir.mkdir(mode=0o700)
        os.chmod(shm_dir, 0o2770)
    dumpdir.ensure(shm_dir)
    # When the hook writes a dump, an error file and its ready marker (under a lax umask)
    old = os.umask(0)
    try:
        dump = _write_dump(shm_dir, "hsd-k-a1-n4")
        marker = write_ready_marker(shm_dir, {})
    finally:
        os.umask(old)
    # Then each is 0600 (0640 in a shared group dir): no other user reads the hidden states
    want = 0o640 if shared else 0o600
    err = err_path(shm_dir, "hsd-k-a1-n4x")
    for p in (dump, err, marker):
        assert stat.S_IMODE(p.stat().st_mode) == want, p
    if not shared:
        os.chmod(shm_dir, 0o755)  # even with the dir itself open to all
    read = subprocess.run([*AS_NOBODY, "cat", str(dump)], capture_output=True)
    assert read.returncode != 0 and b"Permission denied" in read.stderr


@as_root
def test_a_dump_that_is_a_link_or_another_users_file_is_never_read(tmp_path: Path,
                                                                   tiny_model: Path) -> None:
    # Given a valid dump of a 4-token request in a private dump dir
    fp = compute_fingerprint(Settings(), tiny_model)
    d = tmp_path / "dumps"
    dumpdir.ensure(d)
    real = _write_dump(d, "hsd-real-a1-n4", h=fp.hidden_size, config_sha256=fp.config_sha256)
    fp4 = type(fp).from_json({**fp.to_json(), "layers_to_capture": [2, 4, 5]})
    with worker_dumps.open_dump(real, [0, 1, 2, 3], fp4):
        pass  # the genuine one opens
    # When the path a worker reads is a link to it
    link = dump_path(d, "hsd-link-a1-n4")
    link.symlink_to(real)
    # Then it is refused, naming the fix, without reading it
    with pytest.raises(ConfigError, match="is a symbolic link"):
        worker_dumps.open_dump(link, [0, 1, 2, 3], fp4)
    # And a dump owned by another user is refused too
    os.chown(real, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"owned by uid {NOBODY}"):
        worker_dumps.open_dump(real, [0, 1, 2, 3], fp4)
    # And an error file that is a link is not read into a message either
    secret = tmp_path / "secret"
    secret.write_text("not for the log")
    err_path(d, "hsd-e-a1-n4").symlink_to(secret)
    import asyncio

    with pytest.raises(ConfigError, match="is a symbolic link"):
        asyncio.run(worker_dumps.wait_for_dump(d, "hsd-e-a1-n4", 2.0))


@as_root
def test_a_dump_dir_put_in_place_of_the_checked_one_is_never_read_or_written(
        shm_parent: Path, tiny_model: Path) -> None:
    # Given a dump dir that passed its checks, holding a genuine dump
    fp = compute_fingerprint(Settings(), tiny_model)
    fp4 = type(fp).from_json({**fp.to_json(), "layers_to_capture": [2, 4, 5]})
    d = shm_parent / "dumps"
    dumpdir.ensure(d)
    rid = "hsd-k-a1-n4"
    real = _write_dump(d, rid, h=fp.hidden_size, config_sha256=fp.config_sha256)
    with worker_dumps.open_dump(real, [0, 1, 2, 3], fp4):
        pass
    # When its parent passes to another user (nobody), who renames the dump dir away and
    # puts their own at its path, with a forged dump of that name in it
    os.chown(shm_parent, NOBODY, NOBODY)
    forged = d.with_name("forged")
    forged.mkdir()
    shutil.copy(real, forged / real.name)
    for p in (forged, forged / real.name):
        os.chown(p, NOBODY, NOBODY)
    swap = f"mv {d} {d}.old && mv {forged} {d}"
    subprocess.run([*AS_NOBODY, "sh", "-c", swap], check=True)
    assert d.stat().st_uid == NOBODY
    # Then the worker reads nothing of it: the dir at the path is not the one checked, and
    # checked again it is refused, naming why
    with pytest.raises(ConfigError, match=f"owned by uid {NOBODY}"):
        worker_dumps.open_dump(real, [0, 1, 2, 3], fp4)
    # And the hook writes nothing into it
    with pytest.raises(dumpdir.DumpDirUnsafe, match=f"owned by uid {NOBODY}"):
        dumpdir.write_private(d / ".probe.tmp", b"hidden states")
    assert not (d / ".probe.tmp").exists()
    # And a dump dir made again by its own user after a deletion is checked and used
    shutil.rmtree(d)
    os.chown(shm_parent, 0, 0)
    d.mkdir(mode=0o700)
    again = _write_dump(d, rid, h=fp.hidden_size, config_sha256=fp.config_sha256)
    with worker_dumps.open_dump(again, [0, 1, 2, 3], fp4):
        pass


@as_root
def test_a_dump_dir_made_again_by_another_user_with_its_inode_number_is_never_read_or_written(
        disk_sticky: Path, tiny_model: Path) -> None:
    # Given a dump dir that passed its checks, holding a genuine dump, on a disk file system
    # (ext4 gives a new dir the inode number of one just deleted) in a dir that everyone may
    # write to with the sticky bit, as /tmp
    fp = compute_fingerprint(Settings(), tiny_model)
    fp4 = type(fp).from_json({**fp.to_json(), "layers_to_capture": [2, 4, 5]})
    d = disk_sticky / "dumps"
    dumpdir.ensure(d)
    rid = "hsd-k-a1-n4"
    real = _write_dump(d, rid, h=fp.hidden_size, config_sha256=fp.config_sha256)
    with worker_dumps.open_dump(real, [0, 1, 2, 3], fp4):
        pass
    forged = real.read_bytes()
    # When its owner deletes it, and another user (nobody) makes one at its path first, which
    # gets the old dir's device and inode numbers, and puts a dump of that name in it
    _made_again_by_nobody(d)
    (d / real.name).write_bytes(forged)
    os.chown(d / real.name, NOBODY, NOBODY)
    # Then the worker reads nothing of it: refused on its owner, naming the fix
    with pytest.raises(ConfigError, match=f"owned by uid {NOBODY} .*rm -rf {d}"):
        worker_dumps.open_dump(real, [0, 1, 2, 3], fp4)
    # And the hook writes nothing into it
    with pytest.raises(dumpdir.DumpDirUnsafe, match=f"owned by uid {NOBODY}"):
        dumpdir.write_private(d / ".probe.tmp", b"hidden states")
    assert not (d / ".probe.tmp").exists()
    # And one that its own user made open to all is refused too, with the fix
    shutil.rmtree(d)
    d.mkdir(mode=0o700)
    again = _write_dump(d, rid, h=fp.hidden_size, config_sha256=fp.config_sha256)
    os.chmod(d, 0o777)
    with pytest.raises(ConfigError, match=f"others can write to it .*chmod 0700 {d}"):
        worker_dumps.open_dump(again, [0, 1, 2, 3], fp4)
    # And after that fix it is read again
    os.chmod(d, 0o700)
    with worker_dumps.open_dump(again, [0, 1, 2, 3], fp4):
        pass


@as_root
def test_the_dump_writer_writes_nothing_into_a_dump_dir_made_again_by_another_user_and_goes_on(
        disk_sticky: Path) -> None:
    # Given the server's dump writer, started on a dump dir on a disk file system
    d = disk_sticky / "dumps"
    writer = DumpWriter(d, {M_LAYERS: "[2, 4, 5]"}, min_free_bytes=0)
    try:
        writer.submit(_rows("hsd-k-a1-n4"))
        writer.flush(timeout_s=10)
        assert dump_path(d, "hsd-k-a1-n4").exists()
        # When another user (nobody) makes the dump dir again, with its inode number
        _made_again_by_nobody(d)
        # Then the next request's dump is not written into it, nor its error file
        writer.submit(_rows("hsd-k-a2-n4"))
        writer.flush(timeout_s=10)
        assert list(d.iterdir()) == []
        # And once the dump dir is the server's again, the writer writes the next one there
        shutil.rmtree(d)
        d.mkdir(mode=0o700)
        writer.submit(_rows("hsd-k-a3-n4"))
        writer.flush(timeout_s=10)
        assert [p.name for p in d.iterdir()] == [dump_path(d, "hsd-k-a3-n4").name]
    finally:
        writer.close()


def _made_again_by_nobody(d: Path) -> None:
    """Delete ``d`` (checked) and have nobody make a dir at its path with ``d``'s device and
    inode numbers: ext4 gives a new dir a just-deleted inode's number unless another process
    takes it first (this disk is shared), so again with a new ``d`` until it does; skip where
    the file system never does."""
    for _ in range(20):
        st = dumpdir.check(d)
        shutil.rmtree(d)
        subprocess.run([*AS_NOBODY, "mkdir", "-m", "0755", str(d)], check=True)
        again = d.stat()
        if (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino):
            assert again.st_uid == NOBODY
            return
        subprocess.run([*AS_NOBODY, "rmdir", str(d)], check=True)
        d.mkdir(mode=0o700)
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(d.parent)], capture_output=True,
                          text=True).stdout.strip()
    pytest.skip(f"{d.parent} ({kind}) gave a dir made again a new inode number 20 times: the "
                "device and inode tie cannot be fooled there (ext4 does)")


@as_root
def test_a_link_on_the_dump_dirs_path_that_another_user_owns_is_refused_at_start(
        disk_sticky: Path, shm_parent: Path) -> None:
    # Given a link that another user (nobody) made in a dir everyone may write to with the
    # sticky bit (as /tmp), leading to a dir of root's: that user can point it elsewhere
    link = disk_sticky / "link"
    subprocess.run([*AS_NOBODY, "ln", "-s", str(shm_parent), str(link)], check=True)
    d = link / "dumps"
    # When the dump dir is given through it
    # Then the server and the workers refuse it at start, before creating anything through it,
    # naming the link, where it leads and the fix; preflight says the same
    why = f"{link} is a symbolic link owned by uid {NOBODY} (nobody)"
    with pytest.raises(dumpdir.DumpDirUnsafe, match=re.escape(why)) as refused:
        dumpdir.ensure(d)
    assert str(shm_parent / "dumps") in str(refused.value) and f"rm {link}" in str(refused.value)
    assert not (shm_parent / "dumps").exists()
    (shm_parent / "dumps").mkdir(mode=0o700)
    assert why in (dumpdir.problem(d) or "")
    # And a dump dir that is itself such a link is refused the same way
    itself = disk_sticky / "itself"
    subprocess.run([*AS_NOBODY, "ln", "-s", str(shm_parent / "dumps"), str(itself)], check=True)
    with pytest.raises(dumpdir.DumpDirUnsafe, match=re.escape(
            f"dump dir {itself} is a symbolic link owned by uid {NOBODY} (nobody)")):
        dumpdir.check(itself)
    # And a link of root's there, which no one else can point elsewhere, is accepted
    link.unlink()
    link.symlink_to(shm_parent)
    dumpdir.ensure(d)
    # And a link of root's that leads through nobody's link is refused, naming that one
    hop = disk_sticky / "hop"
    subprocess.run([*AS_NOBODY, "ln", "-s", str(shm_parent), str(hop)], check=True)
    (disk_sticky / "via").symlink_to(hop)
    with pytest.raises(dumpdir.DumpDirUnsafe, match=f"{hop} is a symbolic link owned by uid"):
        dumpdir.ensure(disk_sticky / "via" / "dumps")
    # And a link of root's in a dir that nobody owns (who can replace it) is refused as well
    theirs = disk_sticky / "theirs"
    subprocess.run([*AS_NOBODY, "mkdir", "-m", "0755", str(theirs)], check=True)
    (theirs / "link").symlink_to(shm_parent)
    with pytest.raises(dumpdir.DumpDirUnsafe, match=f"is under {theirs}, owned by uid {NOBODY}"):
        dumpdir.ensure(theirs / "link" / "dumps")
