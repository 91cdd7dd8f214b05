"""Every command ops/RUNBOOK.md tells a person to run exists, checked by kind without running it:
``python -m producer`` / ``python -m sglang_patch`` / ``python -m vllm_hook`` against their own
argument parsers;
``ops/`` scripts exist and answer ``--help``; systemd units and compose services exist in
ops/systemd and docker-compose.yml. What needs systemd, Docker or a GPU is said so
(``NOT_HERE``), and the runnable commands cover what a person checks. No farm.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from engine_dump import markers, nccl
from producer.cli import build_parser as producer_parser
from sglang_patch import verify
from tests.support.runbook import COMMANDS, ROOT, RUNNABLE, Command
from vllm_hook import verify as vllm_verify

# Not runnable on this machine, with the reason (they are still checked for existence).
NOT_HERE = {"systemctl": "no systemd here", "journalctl": "no systemd journal here",
            "docker": "no Docker here", "nvidia-smi": "no GPU here",
            "tail": "follows a log forever (-f)"}
SHELL_BUILTINS = {"cd", "set", ".", "export"}


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
        sub = {"verify": verify.build_parser, "markers": markers.build_parser,
               "nccl": nccl.build_parser}
        assert a[3] in sub, f"no sglang_patch command {a[3]}"
        _parses(a[4:], sub[a[3]])
    elif cmd.kind == "python -m vllm_hook":
        sub = {"verify": vllm_verify.build_parser, "markers": markers.build_parser}
        assert a[3] in sub, f"no vllm_hook command {a[3]}"
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
    assert {"python -m producer", "python -m sglang_patch", "python -m vllm_hook", "ops",
            "systemctl", "journalctl", "docker"} <= kinds, kinds
    assert len(COMMANDS) > 25


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.line for c in COMMANDS])
def test_every_runbook_command_exists(cmd: Command) -> None:
    known = {"python -m producer", "python -m sglang_patch", "python -m vllm_hook", "ops",
             *SHELL_BUILTINS,
             *NOT_HERE, "grep", "df", "rsync"}
    assert cmd.kind in known, f"a new kind of command in the runbook: {cmd.line}"
    check_exists(cmd)


# --- the ones that run here, against a real farm ------------------------------------------


def test_runnable_commands_cover_the_checks_a_person_runs() -> None:
    for needed in ("ops/preflight.sh", "ops/launch-sglang.sh --dry-run",
                   "ops/launch-vllm.sh --dry-run",
                   "python -m producer audit", "python -m producer status --failures"):
        assert needed in RUNNABLE, needed
    assert any(x.startswith("python -m producer enqueue") for x in RUNNABLE)
    assert any(x.startswith("python -m sglang_patch verify --live-only") for x in RUNNABLE)


# --- preflight sized to the work that remains ----------------------------------------------
