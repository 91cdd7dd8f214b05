"""A dump dir that another user made first (or can write to), or whose parent another user owns,
is refused by every side that meets it: the reference server, the workers, preflight and the
launcher, each run as a real process; one made again by another user mid-run pauses the workers
until it is fixed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_dump import dumpdir
from engine_dump.dumpfile import READY_PREFIX
from engine_dump.rids import RID_PREFIX
from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import CACHE, FAST_ENV, assert_farm_invariants, served_farm, wait_finished
from tests.support.dumpdir import AS_NOBODY, NOBODY, as_root
from tests.support.dumpdir import disk_sticky as disk_sticky  # a fixture
from tests.support.dumpdir import shm_dir as shm_dir  # a fixture
from tests.support.dumpdir import shm_parent as shm_parent  # a fixture
from tests.support.faults import enqueue, failed, run_hash
from worker.state import keys as keys_mod

ROOT = Path(__file__).resolve().parents[2]


@as_root
def test_a_dump_dir_another_user_made_first_is_refused_by_every_side(
        tmp_path: Path, shm_dir: Path, tiny_model: Path) -> None:
    # Given the dump dir created first by another local user (nobody), open to all
    subprocess.run([*AS_NOBODY, "mkdir", "-m", "0777", str(shm_dir)], check=True)
    assert shm_dir.stat().st_uid == NOBODY
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, dumps=shm_dir,
                     extra_env={**FAST_ENV, "FARM_MODEL_PATH": str(tiny_model)})
    try:
        farm.start_redis()
        fix = f"rm -rf {shm_dir}"
        # When the reference server starts: it refuses, with the fix
        with pytest.raises(RuntimeError, match="exited"):
            farm.start_server()
        log = farm.procs["server"].log.read_text()
        assert f"dump dir {shm_dir} is owned by uid {NOBODY} (nobody)" in log, log[-2000:]
        assert fix in log
        assert not list(shm_dir.iterdir())
        # And a worker exits 2 before consuming, with the fix
        w = farm.start_worker("w1", concurrency=1, wait=False)
        wait_until(lambda: not w.alive(), 60, "the worker to exit")
        log = w.log.read_text()
        assert w.popen is not None and w.popen.returncode == 2, log[-3000:]
        assert f"owned by uid {NOBODY} (nobody)" in log and fix in log
        # And preflight says FAIL with the fix
        pre = subprocess.run([sys.executable, "-m", "producer.preflight"], env=farm._farm_env(),
                             capture_output=True, text=True, timeout=120)
        assert pre.returncode == 1
        assert f"FAIL  dump dir {shm_dir} is owned by uid {NOBODY} (nobody)" in pre.stdout, \
            pre.stdout
        # And the launcher's dry run too
        launch = subprocess.run(["bash", "ops/launch-sglang.sh", "--dry-run"], cwd=ROOT,
                                env={**farm.env(), "PYTHON": sys.executable, "SGLANG_TP": "1"},
                                capture_output=True, text=True, timeout=120)
        assert f"FAIL  dump dir {shm_dir} is owned by uid {NOBODY} (nobody)" in launch.stdout, \
            launch.stdout
        # When its owner makes it group- or world-writable only: refused as well
        os.chown(shm_dir, 0, 0)
        assert "others can write to it" in str(_refusal(shm_dir))
        os.chmod(shm_dir, 0o770)
        assert f"chmod 0700 {shm_dir}" in str(_refusal(shm_dir))
        # And after the fix it names, the server creates it 0700 and starts
        shutil.rmtree(shm_dir)
        farm.start_server()
        assert stat.S_IMODE(shm_dir.stat().st_mode) == 0o700
        marker = next(shm_dir.glob(f"{READY_PREFIX}*"))
        assert stat.S_IMODE(marker.stat().st_mode) == 0o600
    finally:
        farm.close(kill=True)


def _refusal(path: Path) -> dumpdir.DumpDirUnsafe:
    with pytest.raises(dumpdir.DumpDirUnsafe) as e:
        dumpdir.ensure(path)
    return e.value


@as_root
def test_a_dump_dir_whose_parent_another_user_owns_is_refused_by_server_and_worker(
        tmp_path: Path, shm_parent: Path, tiny_model: Path) -> None:
    # Given a dump dir of root's, 0700, in a directory that another user (nobody) owns: that
    # user can rename the dump dir away and put their own at its path
    dumps = shm_parent / "dumps"
    dumps.mkdir(mode=0o700)
    os.chown(shm_parent, NOBODY, NOBODY)
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, dumps=dumps,
                     extra_env={**FAST_ENV, "FARM_MODEL_PATH": str(tiny_model)})
    try:
        farm.start_redis()
        owned = f"is under {shm_parent}, owned by uid {NOBODY} (nobody)"
        fix = f"chown root {shm_parent}"
        # When the reference server starts: it refuses, with the fix
        with pytest.raises(RuntimeError, match="exited"):
            farm.start_server()
        log = farm.procs["server"].log.read_text()
        assert owned in log and fix in log, log[-2000:]
        # And a worker exits 2 before consuming, with the fix
        w = farm.start_worker("w1", concurrency=1, wait=False)
        wait_until(lambda: not w.alive(), 60, "the worker to exit")
        log = w.log.read_text()
        assert w.popen is not None and w.popen.returncode == 2, log[-3000:]
        assert owned in log and fix in log
        # And a parent that its group can write to (no sticky bit) is refused as well
        os.chown(shm_parent, 0, 0)
        os.chmod(shm_parent, 0o775)
        assert f"chmod go-w {shm_parent}" in str(_refusal(dumps))
        # And after the fix it names, the server starts
        os.chmod(shm_parent, 0o755)
        farm.start_server()
    finally:
        farm.close(kill=True)


@as_root
def test_a_dump_dir_made_again_by_another_user_mid_run_pauses_the_workers_until_fixed(
        tmp_path: Path, disk_sticky: Path, tiny_model: Path) -> None:
    # Given a run under way, its dump dir on a disk file system (ext4 gives a dir made again
    # the inode number of the deleted one) in a dir everyone may write to with the sticky bit
    d = disk_sticky / "dumps"
    with served_farm(tmp_path / "farm", 512, dumps=d,
                     server_args=["--forward-delay-s", "0.2"]) as farm:
        farm.start_worker("w1", concurrency=2)
        keys = enqueue(farm, tmp_path, 20)
        wait_until(lambda: len(run_hash(farm, keys_mod.BYTES)) >= 2, 60, "the first samples")
        # When its owner deletes it and another user (nobody) makes one at its path at once
        ino = d.stat().st_ino
        _remove(d)
        subprocess.run([*AS_NOBODY, "mkdir", "-m", "0755", str(d)], check=True)
        print(f"made again by nobody: inode {'the same' if d.stat().st_ino == ino else 'new'}")
        # Then the workers pause, with status saying why and the fix; nothing is failed, and
        # the server writes no dump, error or temp file (each names its rid) into that dir
        why = f"dump dir {d} is owned by uid {NOBODY} (nobody)"
        wait_until(lambda: why in farm.cli("status").stdout, 90, "status to say the workers "
                   "paused on the dump dir", poll_s=1.0)
        assert f"rm -rf {d}" in farm.cli("status").stdout
        assert not failed(farm), failed(farm)
        assert not list(d.glob(f"*{RID_PREFIX}*")), list(d.iterdir())
        # And after that fix (removed, and made again by its owner), the run finishes by itself
        _remove(d)
        os.mkdir(d, 0o700)
        wait_finished(farm, 20, timeout_s=180)
        assert_farm_invariants(farm, keys)


def _remove(d: Path) -> None:
    """``rm -rf d`` while the server and the workers may still add and remove files in it."""
    for _ in range(50):
        with contextlib.suppress(OSError):  # a file made or removed while it was emptied
            shutil.rmtree(d)
        if not os.path.lexists(d):
            return
        time.sleep(0.05)
    raise AssertionError(f"{d} could not be removed")
