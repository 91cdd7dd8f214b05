"""The run's record of its data is the truth, not a path (worker/state/corpus.py): a data file moved
mid-run is found again by its content, its unreadable samples park without holding a process
or starving other files, and records removed from the corpus leave the run, their files kept
aside. Real Redis, real ``celery worker`` processes, the real reference server."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from engine_dump.dumpfile import DUMP_SUFFIX
from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import CACHE, FAST_ENV, assert_farm_invariants, wait_finished
from tests.support.faults import count_line, running_farm, text, write_jsonl
from worker.core import run as runs
from worker.core import setaside
from worker.core.samples import SampleRef
from worker.state import keys
from worker.state.corpus import Corpus
from worker.state.index import RunIndex
from worker.state.queue_scan import broker_depth


def _record(i: int, tag: str = "", with_id: bool = True) -> dict[str, object]:
    rec: dict[str, object] = {"messages": [
        {"role": "user", "content": f"question {tag}{i}"},
        {"role": "assistant", "content": f"answer {tag}{i} " + "word " * (i % 5)}]}
    if with_id:
        rec["id"] = f"{tag}{i:03d}"
    return rec


def _enqueue(farm: LocalFarm, data: Path) -> str:
    res = farm.cli("enqueue", str(data), "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def _export(farm: LocalFarm, dest: Path) -> str:
    """``export --to modelopt`` with torch (``farm.cli`` runs without it, as workers do)."""
    res = subprocess.run([sys.executable, "-m", "producer", "export", "--to", "modelopt",
                          str(dest), "--no-progress"], env=farm.env(), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def _status(farm: LocalFarm) -> dict[str, object]:
    out: dict[str, object] = json.loads(farm.cli("status", "--json").stdout)
    return out


def _done_keys(farm: LocalFarm) -> set[str]:
    r = farm.redis()
    done = [z for z in r.scan_iter(f"{keys.PREFIX}:*:{keys.DONE}")]
    return {text(k) for z in done for k in r.zrange(z, 0, -1)}  # type: ignore[arg-type]


def test_a_data_file_moved_mid_run_parks_its_samples_and_is_found_again(
        tmp_path: Path, tiny_model: Path) -> None:
    # Each forward pass lasts 0.5 s, so the move lands while part1's rest is still unread: a
    # fast machine finished all 8 between the poll and the rename, and nothing parked.
    with running_farm(tmp_path, ["--forward-delay-s", "0.5"]) as farm:
        # Given part1 and part2 (8 samples each) enqueued, part1 first in the queue
        part1 = write_jsonl(tmp_path / "part1.jsonl", [_record(i, "a") for i in range(8)])
        part2 = write_jsonl(tmp_path / "part2.jsonl", [_record(i, "b") for i in range(8)])
        _enqueue(farm, part1)
        _enqueue(farm, part2)
        farm.start_worker("w1", concurrency=2)
        # When part1 is moved after its first samples are done
        wait_until(lambda: len(_done_keys(farm)) >= 2, 120, "two samples done", poll_s=0.1)
        moved = tmp_path / "moved" / "renamed.jsonl"
        moved.parent.mkdir()
        part1.rename(moved)
        # Then part2 is never starved: all of it finishes while part1's rest is parked
        b_keys = {f"b{i:03d}" for i in range(8)}
        wait_until(lambda: b_keys <= _done_keys(farm), 90, "part2 done", poll_s=0.2)
        st = _status(farm)
        parked = int(str(st["parked"]))
        assert parked >= 1 and int(str(st["done"])) + parked == 16, st
        text = farm.cli("status").stdout
        assert re.search(rf"parked    {parked} samples of data file #1, unreadable on .*"
                         rf"{re.escape(str(part1))}.*No such file", text), text
        assert "python -m producer enqueue <its new path>" in text
        assert farm.cli("status", "--check").returncode == 1
        # And enqueue on the new path finds it by its content and re-points it
        out = _enqueue(farm, moved)
        assert f"moved: data file #1 was {part1}" in out, out
        assert count_line(out, "published") == parked
        assert count_line(out, "already done") == 8 - parked
        wait_finished(farm, 16, timeout_s=120)
        assert farm.cli("status", "--check").returncode == 0
        assert "parked" not in farm.cli("status").stdout
        assert_farm_invariants(farm, [f"a{i:03d}" for i in range(8)] + sorted(b_keys))
        # And a file moved again and edited (a record deleted) is found by its records
        lines = moved.read_text().splitlines(keepends=True)
        again = tmp_path / "again.jsonl"
        again.write_text("".join(lines[:-1]))
        moved.unlink()
        out = _enqueue(farm, again)
        assert f"moved: data file #1 was {moved}" in out, out
        assert "removed from the corpus: 1 samples" in out and "set aside: 1 output" in out
        assert (_status(farm)["total"], _status(farm)["done"]) == (15, 15)


def _edit(records: list[dict[str, object]], tag: str, with_id: bool) -> list[dict[str, object]]:
    """3 corrected, 2 deleted (records 3 and 4), 5 appended."""
    out = [dict(r) for r in records]
    for i in range(3):
        out[i]["messages"] = [{"role": "user", "content": f"corrected question {tag}{i}"},
                              {"role": "assistant", "content": f"corrected answer {tag}{i}"}]
    del out[3:5]
    return out + [_record(i, tag, with_id) for i in range(10, 15)]


def test_records_removed_from_the_corpus_leave_the_run_and_their_files_are_kept_aside(
        tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        farm.start_worker("w1", concurrency=2)
        # Given two files of 10 records, one with ids and one without, done
        ided = [_record(i, "i") for i in range(10)]
        plain = [_record(i, "p", with_id=False) for i in range(10)]
        a = write_jsonl(tmp_path / "ided.jsonl", ided)
        b = write_jsonl(tmp_path / "plain.jsonl", plain)
        _enqueue(farm, a)
        _enqueue(farm, b)
        wait_finished(farm, 20)
        before = {p.name for p in (farm.output_dir / "samples").rglob("*.safetensors")}
        assert "exported: 20 samples" in _export(farm, tmp_path / "mo")
        # When each has 3 records corrected, 2 deleted and 5 appended, and is enqueued again
        write_jsonl(a, _edit(ided, "i", True))
        write_jsonl(b, _edit(plain, "p", False))
        out_a, out_b = _enqueue(farm, a), _enqueue(farm, b)
        # Then enqueue says what left: with ids, 2 removed and 3 superseded (same key);
        # without, the 3 corrected have new keys, so 5 removed; 5 files set aside each
        assert "removed from the corpus: 2 samples" in out_a, out_a
        assert "superseded: 3 records" in out_a and "set aside: 5 output files" in out_a
        assert "removed from the corpus: 5 samples" in out_b, out_b
        assert "superseded:" not in out_b and "set aside: 5 output files" in out_b
        assert count_line(out_a, "published") == 8 and count_line(out_b, "published") == 8
        wait_finished(farm, 26)
        # And status, audit, index and export see exactly the current corpus (26 records;
        # 7 samples left the run, the 3 superseded stay under their keys, redone)
        st = _status(farm)
        assert (st["total"], st["done"], st["removed"], st["finished"]) == (26, 26, 7, True)
        audit = farm.cli("audit")
        assert audit.returncode == 0, audit.stdout + audit.stderr
        assert "whole: 26 " in audit.stdout and "not in the corpus: 0 " in audit.stdout
        assert "kept aside: 10 " in audit.stdout
        index = farm.cli("index", "--no-progress")
        assert "indexed: 26 samples" in index.stdout, index.stdout + index.stderr
        rows = (farm.output_dir / "index.jsonl").read_text().splitlines()
        finals = sorted(p.name[: -len(DUMP_SUFFIX)]
                        for p in (farm.output_dir / "samples").rglob("*.safetensors"))
        assert sorted(json.loads(r)["key"] for r in rows) == finals and len(finals) == 26
        # (an export made before the edit loses the 7, takes the 3 corrected anew and the
        # 13 new keys: 3 corrected without ids, 10 appended)
        export = _export(farm, tmp_path / "mo")
        assert "exported: 16 samples" in export, export
        assert "skipped (already exported and verified): 10" in export
        assert "withdrawn (removed from the corpus): 7" in export
        exported = sorted(p.stem for p in (tmp_path / "mo").rglob("*.pt"))
        assert exported == finals
        # And the removed and superseded files are kept aside, not deleted
        aside = setaside.kept_aside(farm.output_dir)
        assert len(aside) == 10
        kept = {p.name.split(".")[0] for p in aside}
        assert {f"i{i:03d}" for i in (0, 1, 2, 3, 4)} <= kept
        assert {f"{k}.safetensors" for k in kept} <= before


def test_parked_samples_are_published_again_once_their_file_reads(tmp_path: Path,
                                                                  tiny_model: Path) -> None:
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE,
                     extra_env={**FAST_ENV, "FARM_MODEL_PATH": str(tiny_model)})
    farm.start_redis()
    try:
        # Given 3 samples parked by a worker that could not read their file (their
        # messages acknowledged), the file gone
        data = write_jsonl(tmp_path / "d.jsonl", [_record(i, "d") for i in range(3)])
        _enqueue(farm, data)
        r = farm.redis()
        r.delete(farm.queue())
        index = RunIndex(r, runs.run_id_of(farm.output_dir))
        corpus = Corpus(index)
        for key, reg in index.all_registered().items():
            corpus.park(SampleRef(key, str(data), reg.offset, reg.length, reg.sha256,
                                  reg.index, reg.fid), "cannot read data file", "host-a")
        data.rename(tmp_path / "away.jsonl")

        # When janitor rounds run while the file is away, then after it is put back
        script = ("import os, sys; from worker.app import app; s = app.settings; "
                  "from worker.steps.parking import resume_parked; "
                  "run, away, back = sys.argv[1:]; n = [resume_parked(s, run, app)]; "
                  "os.rename(away, back); "
                  "n += [resume_parked(s, run, app), resume_parked(s, run, app)]; print(n)")
        res = subprocess.run([sys.executable, "-c", script, index.run_id,
                              str(tmp_path / "away.jsonl"), str(data)],
                             env=farm.env(), capture_output=True, text=True, timeout=60)
        # Then none is published while it is away; after, exactly those samples, once
        assert res.stdout.split("\n")[-2] == "[0, 3, 0]", res.stdout + res.stderr
        assert broker_depth(r, farm.queue()) == (3, 0)
        assert corpus.parked() == {} and corpus.unreadable() == {}
    finally:
        farm.close(kill=True)
