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
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from producer.cli import build_parser as producer_parser
from producer.localfarm.farm import LocalFarm
from sglang_patch import markers, verify
from tests.conftest import CACHE, FAST_ENV, wait_finished, write_samples

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "ops" / "RUNBOOK.md"
# Not runnable on this machine, with the reason (they are still checked for existence).
NOT_HERE = {"systemctl": "no systemd here", "journalctl": "no systemd journal here",
            "docker": "no Docker here", "nvidia-smi": "no GPU here",
            "tail": "follows a log forever (-f)"}
SHELL_BUILTINS = {"cd", "set", ".", "export"}
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


def _units() -> set[str]:
    return {p.name for p in (ROOT / "ops" / "systemd").glob("*.service")}


def _check_unit(name: str) -> None:
    if not name.startswith("hsfarm"):
        return  # someone else's service (an auto-started inference server)
    unit = re.sub(r"@.*", "@", name.removesuffix(".service")) + ".service"
    assert unit in _units(), f"{name}: no ops/systemd/{unit}"


def _parses(parser_args: list[str], build: object) -> None:
    try:
        build().parse_args(parser_args)  # type: ignore[operator]
    except SystemExit as e:
        raise AssertionError(f"does not parse: {parser_args}") from e


def check_exists(cmd: Command) -> None:
    """The command, its subcommand and flags, units or services exist."""
    a = list(cmd.argv)
    if cmd.kind == "python -m producer":
        _parses(a[3:], producer_parser)
    elif cmd.kind == "python -m sglang_patch":
        sub = {"verify": verify.build_parser, "markers": markers.build_parser}
        assert a[3] in sub, f"no sglang_patch command {a[3]}"
        _parses(a[4:], sub[a[3]])
    elif cmd.kind == "ops":
        script = ROOT / a[0]
        assert script.is_file() and os.access(script, os.X_OK), f"{a[0]} missing or not +x"
        res = subprocess.run([str(script), "--help"], capture_output=True, text=True,
                             timeout=30)
        assert res.returncode == 0 and res.stdout.startswith("Usage: "), (a[0], res.stderr)
    elif cmd.kind == "systemctl":
        assert a[1] in ("start", "stop", "restart", "status", "enable", "disable",
                        "list-units"), a
        for unit in a[2:]:
            if not unit.startswith("-"):
                _check_unit(unit)
    elif cmd.kind == "journalctl":
        units = [a[i + 1] for i, w in enumerate(a) if w == "-u"]
        assert units, "journalctl without -u UNIT"
        for unit in units:
            _check_unit(unit)
    elif cmd.kind == "docker":
        services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
        assert a[1:3] == ["compose", "logs"], a
        words = [w for i, w in enumerate(a[3:], 3) if not w.startswith("-")
                 and a[i - 1] not in ("--since", "--tail")]
        assert words and set(words) <= set(services), words
    elif cmd.kind in SHELL_BUILTINS:
        pass
    else:  # a standard tool
        assert cmd.kind in NOT_HERE or shutil.which(cmd.kind), f"{cmd.kind}: not installed"


def test_the_runbook_quotes_commands_of_every_kind() -> None:
    kinds = {c.kind for c in COMMANDS}
    assert {"python -m producer", "python -m sglang_patch", "ops", "systemctl", "journalctl",
            "docker"} <= kinds, kinds
    assert len(COMMANDS) > 25


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.line for c in COMMANDS])
def test_every_runbook_command_exists(cmd: Command) -> None:
    known = {"python -m producer", "python -m sglang_patch", "ops", *SHELL_BUILTINS,
             *NOT_HERE, "grep", "df", "rsync"}
    assert cmd.kind in known, f"a new kind of command in the runbook: {cmd.line}"
    check_exists(cmd)


# --- the ones that run here, against a real farm ------------------------------------------


@pytest.fixture(scope="module")
def farm(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalFarm]:
    """Redis (AOF), the reference server with its dumps on tmpfs, one worker; 6 samples done."""
    work = tmp_path_factory.mktemp("runbook")
    dumps = Path(tempfile.mkdtemp(prefix="hsfarm-test-runbook-", dir="/dev/shm"))
    f = LocalFarm(work / "farm", cache_dir=CACHE, chunked_prefill_size=256, dumps=dumps,
                  extra_env=dict(FAST_ENV))
    try:
        f.start_redis()
        f.start_server()
        f.start_worker("w1", concurrency=2)
        write_samples(work / "train.jsonl", 6)
        res = f.cli("enqueue", str(work / "train.jsonl"), "--no-progress")
        assert res.returncode == 0, res.stderr
        wait_finished(f, 6)
        yield f
    finally:
        f.close(kill=True)
        shutil.rmtree(dumps, ignore_errors=True)


def _runnable(cmd: Command) -> bool:
    return cmd.kind in ("python -m producer", "python -m sglang_patch", "ops", "df") \
        and "/path/to/" not in cmd.line and "--help" not in cmd.argv \
        and cmd.line not in NOT_RUN


RUNNABLE = sorted({c.line for c in COMMANDS if _runnable(c)})


def test_runnable_commands_cover_the_checks_a_person_runs() -> None:
    for needed in ("ops/preflight.sh", "ops/launch-sglang.sh --dry-run",
                   "python -m producer audit", "python -m producer status --failures"):
        assert needed in RUNNABLE, needed
    assert any(x.startswith("python -m producer enqueue") for x in RUNNABLE)
    assert any(x.startswith("python -m sglang_patch verify --live-only") for x in RUNNABLE)


# --- preflight sized to the work that remains ----------------------------------------------
