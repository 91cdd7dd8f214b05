"""A run in flight survives the upgrade: messages the old tree published, this tree's workers do.

The old tree is ``OLD``, the last commit before worker/ was split into layers; its ``enqueue``
publishes, and only then do this tree's workers start: the task name, the task ids and the
message body are the contract between the two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from producer.localfarm.farm import LocalFarm
from tests.conftest import assert_farm_invariants, wait_finished, write_samples
from worker.state.queue_scan import broker_depth

ROOT = Path(__file__).resolve().parents[2]
OLD = "bea1d2e"  # the last commit before the reorganisation into layers
N = 20


def old_tree(dest: Path) -> Path:
    """The tree of ``OLD``, unpacked in ``dest``; fails (never skips) without the commit."""
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", OLD], capture_output=True,
                             timeout=120, check=False)
    if archive.returncode != 0:
        pytest.fail(f"commit {OLD} (the tree before the reorganisation) is not in the clone at "
                    f"{ROOT}: fetch the whole history (git fetch --unshallow): "
                    f"{archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True,
                   timeout=120)
    return dest


@pytest.mark.timeout(420)
def test_messages_the_old_tree_published_are_done_by_the_new_workers(
        farm: LocalFarm, tmp_path: Path, tiny_model: Path) -> None:
    # Given samples enqueued by the old tree's producer (its own code, this Python)
    old = old_tree(tmp_path / "old")
    data = tmp_path / "data.json"
    samples = write_samples(data, N)
    res = subprocess.run([sys.executable, "-m", "producer", "enqueue", str(data),
                          "--no-progress"], cwd=old, env={**farm.env(), "PYTHONPATH": str(old)},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"published: {N}" in res.stdout
    assert broker_depth(farm.redis(), farm.queue()) == (N, 0)  # all waiting, none taken
    # When this tree's workers start and drain the queue
    farm.start_worker("w1", concurrency=2)
    wait_finished(farm, N)
    # Then every sample is done, once, whole
    assert_farm_invariants(farm, [str(s["id"]) for s in samples])
    status = json.loads(farm.cli("status", "--json").stdout)
    assert (status["total"], status["done"], status["queued"], status["failed"]) == (N, N, 0, 0)
