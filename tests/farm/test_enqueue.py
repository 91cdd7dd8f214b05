"""Enqueue against a real Redis: several data files in one run, edits, concurrency, huge
records, a Redis that loses its data, and one that keeps none."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine_dump.dumpfile import (
    DTYPE_BF16,
    DTYPE_FP8,
    T_AUX,
    T_INPUT_IDS,
    T_LOSS_MASK,
    hidden_layout,
)
from producer.localfarm.farm import LocalFarm
from tests.conftest import CACHE, FAST_ENV, assert_farm_invariants, wait_finished
from tests.support.faults import count_line, running_farm, write_jsonl
from worker.core import outdir
from worker.state import keys
from worker.state.queue_scan import broker_depth


def _record(i: int, tag: str = "", with_id: bool = True) -> dict[str, object]:
    rec: dict[str, object] = {"messages": [
        {"role": "user", "content": f"question {tag}{i}"},
        {"role": "assistant", "content": f"answer {tag}{i} " + "word " * (i % 7)}]}
    if with_id:
        rec["id"] = f"s-{i:04d}"
    return rec


def _redis_farm(tmp_path: Path, tiny_model: Path, appendonly: bool = True) -> LocalFarm:
    """Only Redis: the producer knows the model from FARM_MODEL_PATH, no server needed."""
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE,
                     extra_env={**FAST_ENV, "FARM_MODEL_PATH": str(tiny_model)})
    farm.start_redis(appendonly=appendonly)
    return farm


def test_keys_are_unique_across_the_data_files_of_a_run(tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        farm.start_worker("w1", concurrency=2)
        # Given two files of records without ids (keyed by content), both enqueued and done
        a = write_jsonl(tmp_path / "part1.jsonl",
                        [_record(i, "a", with_id=False) for i in range(6)])
        b = write_jsonl(tmp_path / "part2.jsonl",
                        [_record(i, "b", with_id=False) for i in range(6)])
        for f in (a, b):
            res = farm.cli("enqueue", str(f), "--no-progress")
            assert count_line(res.stdout, "published") == 6, res.stdout + res.stderr
        wait_finished(farm, 12)
        # Then each record has its own file: nothing of part1 was overwritten by part2
        files = sorted((farm.output_dir / "samples").rglob("*.safetensors"))
        assert len(files) == 12
        before = {p: p.stat().st_mtime_ns for p in files}
        # When a third file reuses part1's ids... (give part1 ids first: a fourth file)
        ided = write_jsonl(tmp_path / "part3.jsonl", [_record(i, "c") for i in range(4)])
        assert count_line(farm.cli("enqueue", str(ided), "--no-progress").stdout, "published") == 4
        wait_finished(farm, 16)
        clash = write_jsonl(tmp_path / "part4.jsonl", [_record(i, "d") for i in range(4)])
        depth = broker_depth(farm.redis(), farm.queue())
        res = farm.cli("enqueue", str(clash), "--no-progress")
        # Then the whole file is refused with the reason, before anything is published
        assert res.returncode == 2, res.stdout + res.stderr
        assert "Keys must be unique within a run" in res.stderr and "'s-0000'" in res.stderr
        assert broker_depth(farm.redis(), farm.queue()) == depth
        # And also after Redis lost the run index: the files on disk say whose keys they are
        farm.redis().flushall()
        again = farm.cli("enqueue", str(clash), "--no-progress")
        assert again.returncode == 2 and "already holds another record" in again.stderr
        assert {p: p.stat().st_mtime_ns for p in before} == before


def test_an_edited_record_loses_nothing_after_it(tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        # Given 20 records enqueued before any worker runs
        records = [_record(i) for i in range(20)]
        data = write_jsonl(tmp_path / "data.jsonl", records)
        assert count_line(farm.cli("enqueue", str(data), "--no-progress").stdout, "published") == 20
        # When record 5 grows by 8 bytes (every record after it moves) and the workers run
        records[5]["messages"][1]["content"] += " edited!"  # type: ignore[index]
        write_jsonl(data, records)
        farm.start_worker("w1", concurrency=2)
        wait_finished(farm, 19)
        # Then the moved records were found again; only record 5 is stale, and the run does
        # not call itself finished while audit finds it missing
        st = json.loads(farm.cli("status", "--json").stdout)
        assert (st["done"], st["stale"], st["failed"], st["rejected"]) == (19, 1, 0, 0)
        assert farm.cli("status", "--check").returncode == 1
        audit = farm.cli("audit")
        assert audit.returncode == 1 and "missing: 1\n" in audit.stdout, audit.stdout
        # And re-running enqueue publishes exactly it, and the run finishes whole
        res = farm.cli("enqueue", str(data), "--no-progress")
        assert count_line(res.stdout, "published") == 1
        assert count_line(res.stdout, "already done") == 19
        wait_finished(farm, 20)
        assert farm.cli("status", "--check").returncode == 0
        assert_farm_invariants(farm, [f"s-{i:04d}" for i in range(20)])


def test_two_producers_at_once_queue_each_sample_once(tmp_path: Path, tiny_model: Path) -> None:
    farm = _redis_farm(tmp_path, tiny_model)
    try:
        data = write_jsonl(tmp_path / "data.jsonl", [_record(i) for i in range(3000)])
        # When two enqueues of the same file run at the same time
        cmd = [sys.executable, "-m", "producer", "enqueue", str(data), "--no-progress"]
        procs = [subprocess.Popen(cmd, env=farm.env(), stdout=subprocess.PIPE, text=True)
                 for _ in range(2)]
        outs = [p.communicate(timeout=240)[0] for p in procs]
        # Then one published everything and the other found it all queued
        assert sorted(count_line(o, "published") for o in outs) == [0, 3000], outs
        assert broker_depth(farm.redis(), farm.queue()) == (3000, 0)
    finally:
        farm.close(kill=True)


def _maxrss_enqueue(farm: LocalFarm, data: Path) -> tuple[int, str]:
    """Peak resident KB of one enqueue process, and its output."""
    code = ("import atexit, resource, runpy, sys; atexit.register(lambda: print('MAXRSS', "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)); "
            f"sys.argv = ['producer', 'enqueue', {str(data)!r}, '--no-progress']; "
            "runpy.run_module('producer', run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], env=farm.env(), capture_output=True,
                         text=True, timeout=300)
    return int(res.stderr.rsplit("MAXRSS", 1)[1].split()[0]), res.stdout


def test_a_huge_record_is_rejected_unread(tmp_path: Path, tiny_model: Path) -> None:
    farm = _redis_farm(tmp_path, tiny_model)
    try:
        # Given a JSONL file with a 60 MB record between small ones, and the same without it
        small = [json.dumps(_record(i)) for i in range(10)]
        huge = json.dumps({"id": "huge", "messages": [
            {"role": "user", "content": "x" * (60 << 20)}, {"role": "assistant", "content": "y"}]})
        with_huge = tmp_path / "with.jsonl"
        with_huge.write_text("\n".join([*small[:5], huge, *small[5:]]) + "\n")
        without = tmp_path / "without.jsonl"
        without.write_text("\n".join(small) + "\n")
        # When each is enqueued (into runs of their own: separate queues)
        rss_without, _ = _maxrss_enqueue(farm, without)
        farm.redis().flushall()
        rss_with, out = _maxrss_enqueue(farm, with_huge)
        # Then the huge record is rejected by its size, the others are published, and it was
        # never held in memory
        assert count_line(out, "published") == 10, out
        assert re.search(r"line 6: record is \d+ bytes, over FARM_MAX_RECORD_BYTES", out), out
        assert rss_with - rss_without < 20 << 10, (rss_with, rss_without)  # KB
    finally:
        farm.close(kill=True)


def test_volatile_redis_is_refused_unless_allowed(tmp_path: Path, tiny_model: Path) -> None:
    farm = _redis_farm(tmp_path, tiny_model, appendonly=False)
    try:
        data = write_jsonl(tmp_path / "data.jsonl", [_record(i) for i in range(3)])
        # When enqueue meets a Redis that keeps nothing on disk
        res = farm.cli("enqueue", str(data), "--no-progress")
        # Then it refuses, says why and how to fix it, and publishes nothing
        assert res.returncode == 2 and "keeps nothing on disk (appendonly no)" in res.stderr
        assert "FARM_ALLOW_VOLATILE_REDIS=1" in res.stderr
        assert broker_depth(farm.redis(), farm.queue()) == (0, 0)
        # And so does a worker, before it takes anything
        worker = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "worker", "worker", "-c", "1",
             "--without-gossip", "--without-mingle"],
            env=farm.env(), capture_output=True, text=True, timeout=120)
        assert worker.returncode == 2 and "keeps nothing on disk" in worker.stderr
        # Unless the risk is accepted explicitly
        farm.extra_env["FARM_ALLOW_VOLATILE_REDIS"] = "1"
        ok = farm.cli("enqueue", str(data), "--no-progress")
        assert ok.returncode == 0 and count_line(ok.stdout, "published") == 3
    finally:
        farm.close(kill=True)


def test_index_is_rebuilt_from_disk_after_redis_lost_it(tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        farm.start_worker("w1", concurrency=2)
        data = write_jsonl(tmp_path / "data.jsonl", [_record(i) for i in range(12)])
        farm.cli("enqueue", str(data), "--no-progress")
        wait_finished(farm, 12)
        # When Redis loses everything (FLUSHALL) and enqueue runs again
        farm.redis().flushall()
        res = farm.cli("enqueue", str(data), "--no-progress")
        # Then nothing is redone, and status knows the run is complete
        assert count_line(res.stdout, "already done") == 12
        assert count_line(res.stdout, "published") == 0
        status = json.loads(farm.cli("status", "--json").stdout)
        assert (status["total"], status["done"], status["finished"]) == (12, 12, True)
        assert farm.cli("status", "--check").returncode == 0
        assert all(outdir.final_path(farm.output_dir, f"s-{i:04d}").exists() for i in range(12))
        # And each relearnt sample is done when its file was written, not when it was relearnt
        r = farm.redis()
        [done_key] = r.scan_iter(f"{keys.PREFIX}:*:{keys.DONE}")
        for i in range(12):
            path = outdir.final_path(farm.output_dir, f"s-{i:04d}")
            assert r.zscore(done_key, f"s-{i:04d}") == pytest.approx(path.stat().st_mtime)


def test_relearnt_done_needs_the_run_s_dtypes_and_shapes(tmp_path: Path, tiny_model: Path) -> None:
    import numpy as np

    from worker.core import finalfile, tensorfile
    from worker.core.samples import sample_refs

    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE,
                     extra_env={**FAST_ENV, "FARM_MODEL_PATH": str(tiny_model),
                                "FARM_STORE_DTYPE": "fp8_e4m3"})
    farm.start_redis()
    try:
        # Given an fp8 run whose Redis lost its data, and files at its final paths that carry
        # the run's fingerprint id and their records' hashes: one in the run's layout, one of
        # bf16 states, one with a row too few
        data = write_jsonl(tmp_path / "data.jsonl", [_record(i) for i in range(4)])
        assert farm.cli("enqueue", str(data), "--no-progress").returncode == 0
        farm.redis().flushall()
        manifest = json.loads((farm.output_dir / "manifest.json").read_text())
        fid, h = manifest["fingerprint_id"], manifest["fingerprint"]["hidden_size"]
        refs = list(sample_refs(data, 1 << 20, [], []))
        n = 5

        def write(ref: object, layout: dict[str, tuple[str, tuple[int, ...]]]) -> None:
            tensors = {k: tensorfile.Tensor(dt, np.zeros(shape, tensorfile.numpy_dtype(dt)))
                       for k, (dt, shape) in layout.items()}
            path = outdir.final_path(farm.output_dir, ref.key)  # type: ignore[attr-defined]
            path.parent.mkdir(parents=True, exist_ok=True)
            tensorfile.write(path, tensors, {
                finalfile.M_KEY: ref.key,  # type: ignore[attr-defined]
                finalfile.M_FINGERPRINT: fid,
                finalfile.M_CONTENT: ref.sha256})  # type: ignore[attr-defined]

        ids = {T_INPUT_IDS: ("I64", (n,)), T_LOSS_MASK: ("I64", (n,))}
        write(refs[0], {**ids, **hidden_layout(DTYPE_FP8, n, h)})
        write(refs[1], {**ids, **hidden_layout(DTYPE_BF16, n, h)})
        short = hidden_layout(DTYPE_FP8, n, h)
        short[T_AUX] = (short[T_AUX][0], (n - 1, short[T_AUX][1][1]))
        write(refs[2], {**ids, **short})
        # When a worker's start registers the host's files, and enqueue relearns what is
        # done, both from the files' headers
        from worker.state import hosts

        got = hosts.register(farm.redis(), farm.run_id(), "h1", farm.output_dir, fid,
                             farm.settings())
        res = farm.cli("enqueue", str(data), "--no-progress")
        # Then only the file in the run's layout counts as done
        assert (got.files, got.relearnt) == (1, 1), got
        assert count_line(res.stdout, "already done") == 1, res.stdout + res.stderr
        assert count_line(res.stdout, "published") == 3, res.stdout
    finally:
        farm.close(kill=True)
