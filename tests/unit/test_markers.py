"""Ready markers: which are dead (this boot, the process gone or its pid reused), that only
those are ever removed, and what ``python -m sglang_patch verify`` makes of them. Real child
processes write every marker; no server, no other pid namespace.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from engine_dump import markers as mk
from engine_dump.dumpfile import READY_PREFIX, TMP_MARK, WRITER_UNHEALTHY_PREFIX
from engine_dump.live_check import check_marker
from sglang_patch.plugin import ENV_DUMP_DIR
from tests.support.markers import WRITE


def _marker_of_dead_process(dump_dir: Path) -> Path:
    res = subprocess.run([sys.executable, "-c", WRITE, str(dump_dir), "0"], capture_output=True,
                         text=True, check=True, timeout=30)
    return dump_dir / f"{READY_PREFIX}{int(res.stdout)}"


def _sglang(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sglang_patch", *args], capture_output=True,
                          text=True, timeout=30)


def test_dead_live_reused_and_legacy_markers(tmp_path: Path) -> None:
    # Given the marker of a server process that exited, this (live) process's marker, a marker
    # naming this process's pid with another start time (a reused pid), and one of an older
    # hook that does not say who wrote it
    dead = _marker_of_dead_process(tmp_path)
    live = mk.write_ready_marker(tmp_path, {})
    reused = tmp_path / f"{READY_PREFIX}{os.getpid()}x"
    reused.write_text(json.dumps({**json.loads(live.read_text()), "start_ticks": "1"}))
    legacy = tmp_path / f"{READY_PREFIX}999999"
    legacy.write_text(json.dumps({"pid": 999999, "time": time.time()}))
    # When they are judged
    states = {m.path.name: m.state for m in mk.markers(tmp_path)}
    # Then only the exited process and the reused pid are dead
    assert states == {dead.name: mk.DEAD, live.name: mk.ALIVE, reused.name: mk.DEAD,
                      legacy.name: mk.UNKNOWN}
    # And the command removes exactly those, saying so
    res = _sglang("markers", "--dump-dir", str(tmp_path), "--remove-dead")
    assert res.returncode == 0, res.stderr
    assert f"{dead.name}: dead (process {dead.name.rsplit('.', 1)[1]} is gone): removed" \
        in res.stdout
    assert f"{reused.name}: dead (pid {os.getpid()} now belongs to a process started " \
           "later): removed" in res.stdout
    assert res.stdout.endswith(f"ready markers in {tmp_path}: 4, of dead processes: 2, "
                               "removed: 2\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, legacy.name])


def test_a_marker_rewritten_by_a_new_process_after_it_was_judged_dead_stays(
        tmp_path: Path) -> None:
    # Given a dead server's marker, judged dead
    dead = _marker_of_dead_process(tmp_path)
    [judged] = mk.markers(tmp_path)
    assert judged.state == mk.DEAD
    # When a new server that got the same pid writes its marker before the removal runs
    fresh = {**judged.info, "start_ticks": "999", "time": time.time()}
    tmp = dead.with_name(f"{dead.name}{TMP_MARK}")
    tmp.write_text(json.dumps(fresh))
    os.replace(tmp, dead)
    # Then the removal leaves the new marker in place, and nothing else behind
    assert not mk._take_if_unchanged(judged)
    assert json.loads(dead.read_text()) == fresh
    assert [p.name for p in tmp_path.iterdir()] == [dead.name]
    # And a marker still as judged goes
    [again] = mk.markers(tmp_path)
    assert mk._take_if_unchanged(dataclasses.replace(again, info=fresh))
    assert not list(tmp_path.iterdir())


def test_verify_takes_a_live_marker_over_a_newer_dead_one_and_honours_since(
        tmp_path: Path) -> None:
    # Given this process's marker, then a newer one of a server that exited
    mk.write_ready_marker(tmp_path, {"layers_to_capture": [1, 2, 3]})
    time.sleep(0.05)
    _marker_of_dead_process(tmp_path)
    # When verify checks the dump dir, Then the live marker counts
    check = check_marker(tmp_path, max_age_s=3600, env=ENV_DUMP_DIR)
    assert check.ok and f"pid {os.getpid()} (alive)" in check.detail
    # And only the dead one remains to be judged after the live one is gone: a FAIL
    (tmp_path / f"{READY_PREFIX}{os.getpid()}").unlink()
    check = check_marker(tmp_path, max_age_s=3600, env=ENV_DUMP_DIR)
    assert not check.ok and "stale, from an earlier server (process" in check.detail
    # And a marker written before --since does not count (what the launcher waits for)
    later = time.time() + 1
    res = _sglang("verify", "--live-only", "--dump-dir", str(tmp_path), "--since", str(later))
    assert res.returncode == 1
    assert "FAIL  ready marker: none written since" in res.stdout


def test_verify_says_sglang_is_not_installed_even_with_a_sglang_dir_on_the_path(
        tmp_path: Path) -> None:
    # Given the farm's python (no SGLang) run from a directory holding a folder named sglang
    (tmp_path / "sglang").mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for cwd in (Path.cwd(), tmp_path):
        # When verify runs its install checks
        res = subprocess.run([sys.executable, "-m", "sglang_patch", "verify"], cwd=cwd,
                             env=env, capture_output=True, text=True, timeout=60)
        # Then it says SGLang is not installed here, never that SGLang changed its code
        assert res.returncode == 1
        assert res.stdout.startswith(f"FAIL  sglang: SGLang is not installed here "
                                     f"({sys.executable})"), res.stdout
        assert "changed the code" not in res.stdout
        assert len(res.stdout.splitlines()) == 1


GROUP = ("import os, sys, time; from pathlib import Path; "
         "from engine_dump.markers import write_ready_marker; "
         "write_ready_marker(Path(sys.argv[1]), {'layers_to_capture': [2, 30, 58], "
         "'dp_groups': int(sys.argv[3]), 'attn_dp_rank': int(sys.argv[2]), 'tp_size': 4}); "
         "print(os.getpid(), flush=True); time.sleep(float(sys.argv[4]))")


def _group_writer(dump_dir: Path, rank: int, groups: int,
                  live_s: float = 30) -> tuple[subprocess.Popen[str], int]:
    """One DP group's writer of a server: a scheduler process, child of the test (as SGLang's
    schedulers are children of its launcher), that writes its marker and lives ``live_s``."""
    proc = subprocess.Popen([sys.executable, "-c", GROUP, str(dump_dir), str(rank), str(groups),
                             str(live_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_verify_under_dp_attention_needs_a_live_marker_of_every_group_of_the_server(
        tmp_path: Path) -> None:
    # Given a server with two DP groups whose writers both came up
    procs = [_group_writer(tmp_path, rank, 2) for rank in (0, 1)]
    try:
        (_, pid0), (p1, pid1) = procs
        # When verify checks the dump dir, Then it PASSes, naming each group's writer
        res = _sglang("verify", "--live-only", "--dump-dir", str(tmp_path))
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.startswith(f"PASS  ready marker: 2 DP groups of server process "
                                     f"{os.getpid()}: group 0 pid {pid0} (alive), group 1 pid "
                                     f"{pid1} (alive); "), res.stdout
        # When group 1's scheduler dies
        p1.kill()
        p1.wait()
        # Then verify FAILs naming group 1 and its dead writer
        res = _sglang("verify", "--live-only", "--dump-dir", str(tmp_path))
        assert res.returncode == 1
        assert res.stdout.startswith(f"FAIL  ready marker: DP group 1 of 2 (server process "
                                     f"{os.getpid()}): its writer pid {pid1} is dead (process "
                                     f"{pid1} is gone)"), res.stdout
        # When that marker is gone too (removed as dead): group 1 never came up
        (tmp_path / f"{READY_PREFIX}{pid1}").unlink()
        check = check_marker(tmp_path, max_age_s=3600, env=ENV_DUMP_DIR)
        assert not check.ok
        assert check.detail.startswith(f"DP group 1 of 2 (server process {os.getpid()}): no "
                                       f"ready marker; group 0 pid {pid0} (alive)"), check.detail
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()


def test_dp_groups_count_the_ranks_of_one_server(tmp_path: Path) -> None:
    # Given vLLM's dense DP 2: two engines of one server, each saying it is one group of one,
    # with its own rank; and a marker of another server start beside them
    procs = [_group_writer(tmp_path, rank, 1) for rank in (0, 1)]
    other = tmp_path / f"{READY_PREFIX}1"
    other.write_text(json.dumps({"dp_groups": 4, "attn_dp_rank": 3, "ppid": 1, "pid": 1}))
    try:
        found = mk.markers(tmp_path)
        newest = mk.live(found)[-1]
        # Then the server has two groups (the other server's four do not count), and verify
        # checks a live marker of each
        assert mk.dp_groups(newest, found) == 2
        check = check_marker(tmp_path, max_age_s=3600, env=ENV_DUMP_DIR)
        assert check.ok and check.detail.startswith("2 DP groups of server process "), check
        # When rank 1's engine dies, then the count stays two, and verify names the dead one
        p1, pid1 = procs[1]
        p1.kill()
        p1.wait()
        assert mk.dp_groups(newest, mk.markers(tmp_path)) == 2
        check = check_marker(tmp_path, max_age_s=3600, env=ENV_DUMP_DIR)
        assert not check.ok and "DP group 1 of 2" in check.detail and str(pid1) in check.detail
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()


def test_a_vllm_server_start_is_its_id_not_its_writers_parent(tmp_path: Path) -> None:
    # Given the markers of vLLM's DP ranks: one server id, each writer the child of its own
    # engine core; and a later server start whose writer has a parent pid seen before
    def marker(sid: str, ppid: int, rank: int) -> mk.Marker:
        info = {"server_id": sid, "ppid": ppid, "attn_dp_rank": rank, "dp_groups": 1}
        return mk.Marker(tmp_path / f"{READY_PREFIX}{ppid}{rank}", info, mk.UNKNOWN, "")

    rank0, rank1, later = marker("e1", 10, 0), marker("e1", 11, 1), marker("e2", 10, 0)
    # Then the ranks are one server start of two groups, and the later start is another
    assert rank0.server == rank1.server != later.server
    assert mk.dp_groups(rank0, [rank0, rank1, later]) == 2
    assert mk.dp_groups(later, [rank0, rank1, later]) == 1


def test_an_unhealthy_writer_fails_verify_and_its_note_goes_with_it(tmp_path: Path) -> None:
    from engine_dump.dump_writer import remove_stale_files

    # Given this process's ready marker and its writer's note that it is unhealthy, and the
    # note of a writer whose process has exited
    mk.write_ready_marker(tmp_path, {"layers_to_capture": [1, 2, 3]})
    mk.write_unhealthy(tmp_path, "behind: its queue stayed full")
    gone = subprocess.run(
        [sys.executable, "-c", "import os, sys; from pathlib import Path; "
         "from engine_dump.markers import write_unhealthy; "
         "write_unhealthy(Path(sys.argv[1]), 'not running'); print(os.getpid())",
         str(tmp_path)], capture_output=True, text=True, check=True, timeout=30)
    dead_note = tmp_path / f"{WRITER_UNHEALTHY_PREFIX}{int(gone.stdout)}"
    # When verify and the markers command look at the dump dir
    res = _sglang("verify", "--live-only", "--dump-dir", str(tmp_path))
    listing = _sglang("markers", "--dump-dir", str(tmp_path))
    # Then verify fails naming the live writer and why (the dead one's note does not count),
    # and the listing shows both notes
    assert res.returncode == 1
    assert res.stdout.startswith(f"FAIL  ready marker: the server's dump writer is unhealthy: "
                                 f"pid {os.getpid()} (alive): behind: its queue stayed full ")
    assert "not running" not in res.stdout
    assert f"{WRITER_UNHEALTHY_PREFIX}{os.getpid()}: alive (process {os.getpid()} runs): " \
           "its dump writer is unhealthy: behind" in listing.stdout
    assert f"{dead_note.name}: dead" in listing.stdout
    # And a new hook's start removes the dead note, and the writer's own goes when it clears
    assert remove_stale_files(tmp_path) == 1 and not dead_note.exists()
    mk.clear_unhealthy(tmp_path)
    assert check_marker(tmp_path, max_age_s=3600, env=ENV_DUMP_DIR).ok
