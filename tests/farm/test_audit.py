"""audit: read every final file back, report what is missing or corrupt, requeue exactly that."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import assert_farm_invariants, wait_finished, write_samples
from tests.support.faults import enqueue, failed, running_farm
from worker.core import outdir


def test_audit_finds_and_requeue_repairs(tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        farm.start_worker("w1", concurrency=2)
        keys = enqueue(farm, tmp_path, 12)
        wait_finished(farm, 12)
        res = farm.cli("audit")
        assert res.returncode == 0
        # And it showed its progress, with a rate and an ETA, on stderr (unless told not to)
        assert "audit: 100%" in res.stderr and "12/12" in res.stderr, res.stderr
        assert re.search(r"<00:00, +[\d.]+(file/s|s/file)\]", res.stderr), res.stderr
        quiet = farm.cli("audit", "--no-progress")
        assert quiet.returncode == 0 and "audit:" not in quiet.stderr, quiet.stderr
        # Given one file deleted, one with a flipped byte, one truncated
        gone, flipped, cut = (outdir.final_path(farm.output_dir, k) for k in keys[:3])
        gone.unlink()
        data = bytearray(flipped.read_bytes())
        data[-5] ^= 0x10
        flipped.write_bytes(bytes(data))
        cut.write_bytes(cut.read_bytes()[:100])
        # When audited
        res = farm.cli("audit")
        # Then it names each, with counts, and exits 1
        assert res.returncode == 1
        assert "whole: 9 " in res.stdout and "missing: 1\n" in res.stdout
        assert "corrupt: 2\n" in res.stdout
        assert f"missing {keys[0]}" in res.stdout
        assert f"corrupt {keys[1]}: " in res.stdout and "checksum" in res.stdout
        assert f"corrupt {keys[2]}: " in res.stdout and "not a valid safetensors" in res.stdout
        # And --requeue publishes exactly those three, which the worker redoes
        res = farm.cli("audit", "--requeue")
        assert "requeued: 3" in res.stdout, res.stdout
        wait_finished(farm, 12)
        assert_farm_invariants(farm, keys)
        log = farm.procs["w1"].log.read_text()
        redone = {k for k in keys if log.count(f" {k} a1 done n=") == 2}
        assert redone == set(keys[:3])


def _status(farm: LocalFarm) -> dict[str, Any]:
    res = farm.cli("status", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    return dict(json.loads(res.stdout))


@pytest.mark.timeout(420)
def test_a_file_damaged_after_done_is_not_done_once_requeued_and_its_failure_counts(
        tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        # Given a finished run of 12
        farm.start_worker("w1", concurrency=2)
        keys = enqueue(farm, tmp_path, 12)
        wait_finished(farm, 12)
        bad = keys[0]
        # And one byte of a final file flipped (bit rot), and a server that now fails that
        # sample on every attempt (its dumps hold a NaN)
        path = outdir.final_path(farm.output_dir, bad)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x10
        path.write_bytes(bytes(data))
        farm.procs["server"].stop()
        farm.start_server(["--inject-fault", f"nan:{bad}"])
        # When audit requeues it
        res = farm.cli("audit", "--requeue", "--no-progress")
        assert res.returncode == 1 and "corrupt: 1\n" in res.stdout, res.stdout + res.stderr
        assert "requeued: 1" in res.stdout, res.stdout
        # Then it is no longer done at once, and its failure for good is recorded
        assert _status(farm)["done"] == 11
        wait_until(lambda: bad in failed(farm), 240, f"{bad} to fail for good")
        wait_finished(farm, 12)
        st = _status(farm)
        assert (st["done"], st["failed"], st["finished"]) == (11, 1, True), st
        check = farm.cli("status", "--check")
        assert check.returncode == 1, check.stdout + check.stderr
        # And enqueue neither calls it done nor publishes it again (it failed: --retry-failed)
        again = farm.cli("enqueue", str(tmp_path / "data.json"), "--no-progress")
        assert "already done: 11\n" in again.stdout and "published: 0\n" in again.stdout, (
            again.stdout)
        assert "rejected/failed earlier in this run: 0/1" in again.stdout, again.stdout
        assert _status(farm)["done"] == 11


@pytest.mark.timeout(420)
def test_done_samples_whose_files_are_gone_are_not_done_and_enqueue_redoes_them(
        tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        # Given a finished run of 8, then 4 of its final files deleted
        farm.start_worker("w1", concurrency=2)
        keys = enqueue(farm, tmp_path, 8)
        wait_finished(farm, 8)
        for key in keys[:4]:
            outdir.final_path(farm.output_dir, key).unlink()
        # When status looks
        st = _status(farm)
        # Then they do not count as done, and the run is not finished
        assert (st["done"], st["finished"]) == (4, False), st
        check = farm.cli("status", "--check")
        assert check.returncode == 1 and "4 samples marked done have no file" in check.stderr, (
            check.stdout + check.stderr)
        # And enqueue publishes exactly those again, which the worker redoes
        again = farm.cli("enqueue", str(tmp_path / "data.json"), "--no-progress")
        assert "published: 4\n" in again.stdout and "already done: 4\n" in again.stdout, (
            again.stdout)
        wait_finished(farm, 8)
        wait_until(lambda: _status(farm)["done"] == 8, 120, "the 4 samples to be redone")
        assert_farm_invariants(farm, keys)
        assert farm.cli("status", "--check").returncode == 0


@pytest.mark.timeout(300)
def test_audit_checks_the_records_enqueue_took_under_its_limit(
        tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        # Given the first 6 records of a file of 10 enqueued (--limit) and done
        farm.start_worker("w1", concurrency=2)
        data = tmp_path / "data.json"
        write_samples(data, 10)
        res = farm.cli("enqueue", str(data), "--limit", "6", "--no-progress")
        assert "published: 6\n" in res.stdout, res.stdout + res.stderr
        wait_finished(farm, 6)
        # When audited, with the data file named and without
        for args in (("--data", str(data)), ()):
            res = farm.cli("audit", "--no-progress", *args)
            # Then only those 6 are checked, all whole, and it says why
            assert res.returncode == 0, res.stdout + res.stderr
            assert "checked: 6\n" in res.stdout and "missing: 0\n" in res.stdout, res.stdout
            assert "the first 6 records (enqueue --limit 6)" in res.stdout, res.stdout


@pytest.mark.timeout(420)
def test_a_stray_message_of_a_done_sample_whose_file_rotted_records_its_redo(
        tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        # Given a finished run of 4, a copy of one sample's task message kept from its enqueue
        keys = enqueue(farm, tmp_path, 4)
        r, queue, bad = farm.redis(), farm.queue(), keys[0]  # the queue is the run's: after
        queued = r.lrange(queue, 0, -1)
        stray = next((m for m in queued if json.loads(m)["headers"]["id"].endswith(f":{bad}")),
                     None)
        assert stray is not None, [json.loads(m)["headers"]["id"] for m in queued]
        farm.start_worker("w1", concurrency=2)
        wait_finished(farm, 4)
        # And that sample's file rotted (one byte flipped), and a server that now fails it
        path = outdir.final_path(farm.output_dir, bad)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x10
        path.write_bytes(bytes(data))
        farm.procs["server"].stop()
        farm.start_server(["--inject-fault", f"nan:{bad}"])
        # When its message comes again (no audit, no requeue: a redelivery, a duplicate)
        msg = json.loads(stray)
        msg["properties"]["delivery_tag"] = "stray-1"
        r.lpush(queue, json.dumps(msg))
        # Then the worker that finds the file damaged takes the sample out of done, and its
        # failure for good is recorded
        wait_until(lambda: bad in failed(farm), 240, f"{bad} to fail for good")
        st = _status(farm)
        assert (st["done"], st["failed"]) == (3, 1), st
        assert farm.cli("status", "--check").returncode == 1
