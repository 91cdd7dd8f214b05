"""The runbook commands this machine can run are run, exactly as quoted, against a real farm
(Redis with AOF, the reference server, one Celery worker, 6 samples done) and print what the
runbook says they print; so do its preflight checks of the output disk and the checkpoint.

The commands are read by tests/support/runbook.py; that each exists is tests/unit/test_runbook.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from producer.localfarm.farm import LocalFarm
from tests.conftest import CACHE, FarmFactory, wait_finished, write_samples
from tests.support.runbook import ROOT, RUNNABLE

# --- the ones that run here, against a real farm ------------------------------------------

@dataclass
class Ran:
    line: str
    rc: int
    out: str


@pytest.fixture(scope="module")
def farm(module_farm_factory: FarmFactory) -> Iterator[LocalFarm]:
    """Redis (AOF), the reference server with its dumps on tmpfs, one worker; 6 samples done.
    The output dir is a file system of its own (a 2 GiB tmpfs, as root): what preflight says
    of its free space moves only with this farm's files, never with the rest of the machine."""
    dumps = Path(tempfile.mkdtemp(prefix="hsfarm-test-runbook-", dir="/dev/shm"))
    mounted: list[Path] = []
    try:
        f = module_farm_factory("runbook", dumps=dumps)
        f.output_dir.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=0755", "tmpfs",
                           str(f.output_dir)], capture_output=True).returncode == 0:
            mounted.append(f.output_dir)
        f.start_worker("w1", concurrency=2)
        data = f.work_dir.parent / "train.jsonl"
        write_samples(data, 6)
        res = f.cli("enqueue", str(data), "--no-progress")
        assert res.returncode == 0, res.stderr
        wait_finished(f, 6)
        yield f
        f.close(kill=True)  # before its dumps go
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        shutil.rmtree(dumps, ignore_errors=True)


def run_here(farm: LocalFarm, line: str, **extra: str) -> Ran:
    """One runbook line in bash, in the repository, with the farm's environment; ``python``
    is this venv's, /data/train.jsonl the farm's data file."""
    data = farm.work_dir.parent / "train.jsonl"
    env = {**farm._farm_env(), **extra,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-c", line.replace("/data/train.jsonl", str(data))],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    return Ran(line, res.returncode, res.stdout + res.stderr)


def expect(ran: Ran) -> None:
    """What each runnable runbook command prints when right (as the runbook says)."""
    line, out = ran.line, ran.out
    if line.startswith("python -m producer enqueue"):
        assert ran.rc == 0 and "records: 6\n" in out and "already done: 6\n" in out, out
    elif line.startswith("python -m producer status"):  # its wording is not pinned here
        watching = "--watch" in line and ran.rc == 124  # still watching after 15 s: fine
        assert (ran.rc == 0 or watching) and out.strip() and "Traceback" not in out, out
    elif line.startswith("python -m producer audit"):
        assert ran.rc == 0 and "whole: 6 " in out and "missing: 0\n" in out, out
    elif line == "python -m producer settings":
        assert ran.rc == 0 and "\nFARM_OUTPUT_DIR=" in out, out
    elif line == "python -m sglang_patch verify":  # the install checks: no SGLang here
        assert ran.rc == 1 and out.startswith("FAIL  sglang: SGLang is not installed here"), out
    elif line.startswith("python -m sglang_patch verify --live-only"):
        assert ran.rc == 0 and "PASS  ready marker: pid " in out, out
        if "--server" in line:  # the probe is asked for: one request of ours, dumped right
            assert "PASS  probe request: a 16-token request of ours through" in out, out
        else:  # the markers only: nothing is sent to the server
            assert "probe request" not in out and out.count("\n") == 1, out
    elif line.startswith("python -m sglang_patch markers"):
        assert ran.rc == 0 and re.search(r": \d+, of dead processes: 0\n$", out), out
    elif line == "ops/preflight.sh":
        levels = [x.split()[0] for x in out.splitlines()]
        assert ran.rc == 0 and set(levels) <= {"OK", "WARN"}, out
        assert re.search(r"^OK    output disk .*: [\d.,]+ GiB free, the 0 remaining samples", out,
                         re.M), out
    elif line == "ops/launch-sglang.sh --dry-run":
        # here SGLang is not installed and the reference server holds the port: both FAIL
        assert ran.rc == 1 and "\nwould run, once the FAILs above are fixed:\n" in out, out
        assert re.search(r"^FAIL  port \d+: something already listens there \(/model_info: ",
                         out, re.M), out
    elif line == "ops/launch-vllm.sh --dry-run":
        # here vLLM is not installed and the reference server holds the port: both FAIL
        assert ran.rc == 1 and "\nwould run, once the FAILs above are fixed:\n" in out, out
        assert "FAIL  vllm version: vLLM is not installed here" in out, out
        assert re.search(r"^FAIL  port \d+: something already listens there", out, re.M), out
        assert "--kv-transfer-config" in out.splitlines()[-1] or "FAIL  hook layout" in out, out
    elif line.startswith("df -h"):
        assert ran.rc == 0 and out.count("\n") == 3, out
    else:
        raise AssertionError(f"the runbook quotes a runnable command with no expectation: {line}")


@pytest.mark.parametrize("line", RUNNABLE)
def test_runbook_command_runs_here(farm: LocalFarm, tiny_model: Path, line: str) -> None:
    # Given a farm that finished its run; When the runbook's command runs as quoted
    quoted = f"timeout 15 {line}" if "--watch" in line else line
    ran = run_here(farm, quoted, FARM_MODEL_PATH=str(tiny_model), PYTHON=sys.executable)
    ran.line = line
    # Then it prints what the runbook says it prints
    expect(ran)


# --- preflight sized to the work that remains ----------------------------------------------

def test_preflight_sizes_the_output_disk_to_the_remaining_samples(
        farm: LocalFarm, tmp_path: Path) -> None:
    # Given the run's 6 done files on an output file system of the farm's own (its free
    # space holds still while other tests fill and free the machine's disk), and 4 more
    # samples enqueued on a queue no worker takes, so 4 remain at the run's average file size
    if subprocess.run(["mountpoint", "-q", str(farm.output_dir)]).returncode != 0:
        pytest.skip("needs root to mount the output dir's own tmpfs: the machine's disk "
                    "moves by more than 4 samples' bytes between two reads")
    data = tmp_path / "more.jsonl"
    write_samples(data, 4, start=6)
    enqueue = f"python -m producer enqueue {data} --no-progress"
    assert run_here(farm, enqueue, FARM_QUEUE="elsewhere").rc == 0
    try:
        free = shutil.disk_usage(farm.output_dir).free
        # When preflight runs with a reserve that leaves less than 4 files' worth, then more
        short = run_here(farm, "ops/preflight.sh",
                         FARM_MIN_FREE_OUTPUT_BYTES=str(free - 200_000))
        enough = run_here(farm, "ops/preflight.sh", FARM_MIN_FREE_OUTPUT_BYTES="0")
    finally:  # the farm's worker does them: the run is whole again for any test after this
        farm.redis().delete("elsewhere")
        assert run_here(farm, enqueue).rc == 0
        wait_finished(farm, 10)
    # Then the output disk line FAILs with the shortfall, or is OK, with the numbers
    line = re.search(r"^(OK|FAIL)  +output disk .*$", short.out, re.M)
    assert line and line.group(1) == "FAIL", short.out
    assert re.search(r"the 4 remaining samples need ~[\d.]+ MB \(average [\d.]+ MB over 6 "
                     r"done\) \+ the reserve of [\d.,]+ GiB: [\d.]+ MB short", line.group(0))
    assert short.rc == 1
    assert re.search(r"^OK    output disk .*the 4 remaining samples need", enough.out, re.M)


def test_preflight_checks_the_checkpoint_against_the_runs_weights_identity(
        farm: LocalFarm, tiny_model: Path) -> None:
    from sglang_patch.tiny_model import ensure_tiny_model

    # Given the run's own checkpoint, then another of the same config (a "fine-tune")
    right = run_here(farm, "ops/preflight.sh", FARM_MODEL_PATH=str(tiny_model))
    other = ensure_tiny_model(CACHE, seed=1)
    wrong = run_here(farm, "ops/preflight.sh", FARM_MODEL_PATH=str(other))
    # Then preflight says which one the run came from, and fails the other naming the fix
    assert re.search(rf"^OK    weights: {re.escape(str(tiny_model))} is the run's checkpoint",
                     right.out, re.M), right.out
    assert re.search(rf"^FAIL  weights: the weights in {re.escape(str(other))} are not the "
                     r"checkpoint this run's hidden states came from .*sampled bytes differ",
                     wrong.out, re.M), wrong.out
    assert wrong.rc == 1
