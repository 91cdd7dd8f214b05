"""The worker package installed alone (its ``worker`` extra only) into a fresh venv extracts a
sample; without a library it needs, it stops with the fix and records no sample as rejected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, assert_farm_invariants, wait_finished, write_samples
from tests.support.faults import run_hash, running_farm
from worker.state import keys
from worker.state.queue_scan import broker_depth

INSTALL_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def worker_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install <this project>[worker]`` into a new venv: the dependencies it declares,
    no more."""
    venv = tmp_path_factory.mktemp("worker-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    res = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"{ROOT}[worker]"],
                         capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert res.returncode == 0, res.stdout + res.stderr
    return venv / "bin" / "python"


def _cli(python: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "producer", *args], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 300)
def test_the_worker_alone_extracts_and_a_missing_library_stops_it(
        worker_venv: Path, tmp_path: Path, tiny_model: Path) -> None:
    # Given the reference server (from the dev venv) and the worker package alone in a venv
    torch_there = subprocess.run([str(worker_venv), "-c", "import torch"], capture_output=True)
    assert torch_there.returncode != 0  # the worker side is installed without torch
    with running_farm(tmp_path) as farm:
        data = tmp_path / "one.json"
        write_samples(data, 1)
        # When that venv's producer enqueues a sample and its celery worker extracts it
        res = _cli(worker_venv, farm.env(), "enqueue", str(data), "--no-progress")
        assert res.returncode == 0, res.stdout + res.stderr
        farm.start_worker("fresh", concurrency=1, python=str(worker_venv))
        wait_finished(farm, 1)
        # Then the sample is done and verified
        key = str(json.loads(data.read_text())[0]["id"])
        assert_farm_invariants(farm, [key])
        farm.procs["fresh"].stop()
        # When jinja2 (which chat templates need) is then missing from that venv
        pip = worker_venv.parent / "pip"
        subprocess.run([str(pip), "uninstall", "-y", "-q", "jinja2"], check=True, timeout=120)
        more = tmp_path / "more.json"
        write_samples(more, 3, start=1)
        # Then enqueue, which renders nothing, still publishes; audit, which renders, stops at
        # start-up with the fix (a configuration error, exit 2)
        res = _cli(worker_venv, farm.env(), "enqueue", str(more), "--no-progress")
        assert res.returncode == 0 and "published: 3" in res.stdout, res.stdout + res.stderr
        res = _cli(worker_venv, farm.env(), "audit")
        assert res.returncode == 2, res.stdout + res.stderr
        assert "error: cannot render the chat template" in res.stderr
        assert "jinja2" in res.stderr and "pip install hsfarm" in res.stderr
        # And so does a worker of that venv, with the message in its log
        worker = farm.start_worker("nojinja", concurrency=1, python=str(worker_venv),
                                   wait=False)
        assert worker.popen is not None and worker.popen.wait(120) == 2
        assert "jinja2" in worker.log.read_text(errors="replace")
        # And no sample was recorded as rejected for any of it: all three wait in the queue
        assert run_hash(farm, keys.REJECTED) == {}
        assert broker_depth(farm.redis(), farm.queue()) == (3, 0)
