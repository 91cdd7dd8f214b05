"""Every command the guide, the runbook and docs/ quote works as written, at ``--help`` level:
the program and its subcommand exist, and so does each flag it passes. And every file a page,
a module or a unit names is in the repo.

Our own programs are asked through their own ``--help`` (each ``python -m`` module and
subcommand once, in a subprocess: their parsers are built inside ``main``), Celery's through
its click commands and Flower's options (Flower takes its flags through tornado). Other
programs (pip, git, SGLang's launcher) are the user's, not ours: not checked here. No farm.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import pytest

from tests.support.runbook import DOC_COMMANDS, ROOT, Command

OURS = ("python -m producer", "python -m producer.preflight", "python -m sglang_patch",
        "python -m sglang_patch.reference_server", "python -m vllm_hook",
        "python -m training", "celery", "ops")
CHECKED = [c for c in DOC_COMMANDS if c.kind in OURS]
# Modules whose first word is a subcommand (the others take flags only)
WITH_SUBCOMMANDS = ("producer", "sglang_patch", "vllm_hook", "training")
PLACEHOLDERS = ("...", "…", "/")


@functools.cache
def _help(argv: tuple[str, ...]) -> str:
    """What ``argv --help`` prints (our modules run from this tree, as a user runs them)."""
    res = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, f"{' '.join(argv)} --help exits {res.returncode}: {res.stderr}"
    return res.stdout


def _flags(words: list[str]) -> list[str]:
    """The flags among ``words`` (``--x=v`` as ``--x``), up to a ``--`` that ends them."""
    out = []
    for w in words:
        if w == "--":
            break
        w = w.strip("[]")
        if re.match(r"^--?[A-Za-z]", w):
            out.append(w.split("=", 1)[0])
    return out


def _missing(flags: list[str], help_text: str) -> list[str]:
    return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]


def _check_module(cmd: Command) -> None:
    module, rest = cmd.argv[2], list(cmd.argv[3:])
    argv: tuple[str, ...] = (sys.executable, "-m", module)
    # `python -m producer` or `python -m producer …` alone names the program
    if module in WITH_SUBCOMMANDS and rest and rest[0] != "…":
        assert rest[0] not in PLACEHOLDERS, f"no subcommand: {cmd.line}"
        argv += (rest.pop(0),)
    text = _help(argv)
    assert not _missing(_flags(rest), text), \
        f"{cmd.line}: no such flag {_missing(_flags(rest), text)} in `{' '.join(argv[2:])}`"


def _check_celery(cmd: Command) -> None:
    from celery.bin.celery import celery as group
    from flower.options import options as flower_options

    words = list(cmd.argv[1:])
    assert words[:2] in (["-A", "worker"], ["--app", "worker"]), \
        f"{cmd.line}: celery without -A worker finds no hsfarm app"
    sub = words[2] if len(words) > 2 else ""
    assert sub in group.commands, f"{cmd.line}: celery has no command {sub!r}"
    flags = _flags(words[3:])
    if sub == "flower":  # tornado's options: --max_tasks and --max-tasks are one
        missing = [f for f in flags if f.lstrip("-").replace("_", "-") not in flower_options]
    else:
        known = {o for p in group.commands[sub].params for o in p.opts}
        missing = [f for f in flags if f not in known]
    assert not missing, f"{cmd.line}: celery {sub} has no {missing}"


def _check_ops(cmd: Command) -> None:
    script = ROOT / cmd.argv[0]
    assert script.is_file() and os.access(script, os.X_OK), f"{cmd.argv[0]}: missing or not +x"
    text = _help((str(script),))
    assert not _missing(_flags(list(cmd.argv[1:])), text), f"{cmd.line}: not in its --help"


def test_the_pages_quote_commands_of_every_kind_of_ours() -> None:
    assert {c.kind for c in CHECKED} == set(OURS)
    assert len(CHECKED) > 100


@pytest.mark.parametrize("cmd", CHECKED, ids=[f"{c.kind}: {c.line}" for c in CHECKED])
def test_every_documented_command_of_ours_exists_as_written(cmd: Command) -> None:
    # Given a command a page tells a person to type
    # When its program answers --help, Then the subcommand and every flag are there
    if cmd.kind == "celery":
        _check_celery(cmd)
    elif cmd.kind == "ops":
        _check_ops(cmd)
    else:
        _check_module(cmd)
