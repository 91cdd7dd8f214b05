"""Every command ops/RUNBOOK.md tells a person to run exists, and the ones this machine can run
are run, exactly as quoted, against a real farm (Redis with AOF, the reference server, a
Celery worker) and print what the runbook says they print.

The commands are taken from the runbook's ``sh`` code blocks (every block is ``sh`` or
``text``) and from its inline code that starts like a command. Each is checked by kind:
``python -m producer`` / ``python -m sglang_patch`` against their own argument parsers;
``ops/`` scripts exist and answer ``--help``; systemd units and compose services exist in
ops/systemd and docker-compose.yml. What needs systemd, Docker or a GPU cannot run here and
is said so (``NOT_HERE``).
"""

from __future__ import annotations

import os
import re
import shlex
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

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "ops" / "RUNBOOK.md"
# Not runnable on this machine, with the reason (they are still checked for existence).
COMMAND_START = re.compile(r"^(?:[A-Z_]+=\S+ )*(python -m |ops/\S+\.sh|systemctl |journalctl "
                           r"|celery |docker compose )")
# Runnable here but not run: each starts something for good, or is run elsewhere.
NOT_RUN = {"ops/launch-sglang.sh": "starts SGLang (its --dry-run runs here)",
           "ops/start-redis.sh": "starts the production Redis",
           "python -m producer demo": "the whole demo (tests/farm/test_demo.py runs it)",
           "python -m producer dashboard --basic-auth-file /etc/hsfarm/dashboard-auth":
               "serves until stopped (tests/farm/test_dashboard.py runs it against a farm)",
           "python -m producer enqueue /data/train.jsonl --redo-host hostB":
               "needs a second host the run has not heard from (tests/farm/test_hosts.py)",
           "python -m producer index --from /data/hsfarm-out --from /mnt/hostB/hsfarm-out":
               "needs a second host's output dir (tests/farm/test_training.py indexes two roots)",
           "python -m producer export --to speculators /data/export --from /data/hsfarm-out "
           "--from /mnt/hostB/hsfarm-out":
               "needs a second host's output dir (tests/farm/test_training.py exports two roots)"}


@dataclass(frozen=True)
class Command:
    line: str  # as quoted in the runbook (one command of a pipeline or list)
    argv: tuple[str, ...]  # without leading VAR=value assignments

    @property
    def kind(self) -> str:
        a = self.argv
        if a[:2] == ("python", "-m"):
            return f"python -m {a[2]}"
        return "ops" if a[0].startswith("ops/") else a[0]


def _split(line: str) -> list[list[str]]:
    """Shell words of each simple command in ``line`` (split at ; | && ||), comments out."""
    line = re.sub(r"<[a-z][a-z ]*>", "PLACEHOLDER", line)  # `<that service>`
    lex = shlex.shlex(line, posix=True, punctuation_chars=";|&")
    lex.whitespace_split = True
    out: list[list[str]] = [[]]
    for tok in lex:
        if tok in (";", "|", "&&", "||"):
            out.append([])
        else:
            out[-1].append(tok)
    return [words for words in out if words]


def runbook_commands() -> list[Command]:
    text = RUNBOOK.read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    assert blocks and all(lang in ("sh", "text") for lang, _ in blocks), \
        "every code block of the runbook is sh (commands) or text (what they print)"
    lines = [x for lang, body in blocks if lang == "sh" for x in body.splitlines()]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    lines += [x for x in re.findall(r"`([^`\n]+)`", prose) if COMMAND_START.match(x)]
    cmds = []
    for line in lines:
        for words in _split(line):
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words = words[1:]
            if words:
                cmds.append(Command(line.split("  #")[0].strip(), tuple(words)))
    return cmds


COMMANDS = runbook_commands()


# --- the ones that run here, against a real farm ------------------------------------------

@dataclass
class Ran:
    line: str
    rc: int
    out: str


@pytest.fixture(scope="module")
def farm(module_farm_factory: FarmFactory) -> Iterator[LocalFarm]:
    """Redis (AOF), the reference server with its dumps on tmpfs, one worker; 6 samples done."""
    dumps = Path(tempfile.mkdtemp(prefix="hsfarm-test-runbook-", dir="/dev/shm"))
    try:
        f = module_farm_factory("runbook", dumps=dumps, workers=("w1",))
        data = f.work_dir.parent / "train.jsonl"
        write_samples(data, 6)
        res = f.cli("enqueue", str(data), "--no-progress")
        assert res.returncode == 0, res.stderr
        wait_finished(f, 6)
        yield f
        f.close(kill=True)  # before its dumps go
    finally:
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


def _runnable(cmd: Command) -> bool:
    return cmd.kind in ("python -m producer", "python -m sglang_patch", "ops", "df") \
        and "/path/to/" not in cmd.line and "--help" not in cmd.argv \
        and cmd.line not in NOT_RUN


RUNNABLE = sorted({c.line for c in COMMANDS if _runnable(c)})


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
        assert "PASS  probe request: a 16-token request of ours through" in out, out
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
    # Given the run's 6 done files, and 4 more samples enqueued on a queue no worker takes,
    # so 4 remain at the run's average file size
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
