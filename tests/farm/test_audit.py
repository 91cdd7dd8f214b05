"""audit: read every final file back, report what is missing or corrupt, requeue exactly that."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import assert_farm_invariants, wait_finished
from tests.support.faults import enqueue, running_farm
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
