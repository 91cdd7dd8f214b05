"""The commands the guide and the reference pages tell a person to run, as the tests read them.

From a page's shell code blocks and its inline code that starts like a command, one ``Command``
per simple command. ``COMMANDS``: ops/RUNBOOK.md's (its blocks are ``sh`` or ``text`` only);
``DOC_COMMANDS``: every page's (README.md, the runbook, docs/), checked, never run;
``RUNNABLE``: the runbook lines this machine can run (not ``NOT_RUN``). Inline code that names
a producer command alone (`` `status --failures` ``) is read as
``python -m producer status --failures``: a person types it so.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "ops" / "RUNBOOK.md"
DOC_PAGES = [ROOT / "README.md", RUNBOOK, *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_START = re.compile(r"^(?:[A-Z_]+=\S+ )*(python -m |ops/\S+\.sh|systemctl |journalctl "
                           r"|celery |docker compose )")
# A producer command named alone in prose: `status --failures`, `enqueue --limit 50`
PRODUCER_ALONE = re.compile(r"^(enqueue|status|audit|adopt|index|export|dashboard|settings|demo)"
                            r" --?[a-z]")
SHELL_BLOCKS = ("", "sh", "bash", "shell", "console")

# Runnable here but not run: each starts something for good, or is run elsewhere.
NOT_RUN = {"ops/launch-sglang.sh": "starts SGLang (its --dry-run runs here)",
           "ops/launch-vllm.sh": "starts vLLM (its --dry-run runs here)",
           "ops/launch-vllm.sh -- --enable-expert-parallel": "starts vLLM",
           "ops/start-redis.sh": "starts the production Redis",
           "python -m producer demo": "the whole demo (tests/farm/test_demo.py runs it)",
           "python -m sglang_patch nccl --log-dir /var/log/hsfarm/nccl-30000":
               "reads a multi-GPU server's NCCL logs (tests/unit/test_nccl.py reads fixtures)",
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


def split_commands(line: str) -> list[list[str]]:
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


def page_commands(page: Path) -> list[Command]:
    """Every command ``page`` quotes: its shell blocks' lines that start like a command (a
    continued line joined), and its inline code that does."""
    text = page.read_text()
    blocks = re.findall(r"^ *```(\w*)\n(.*?)^ *```", text, re.M | re.S)
    block_lines = [x.strip() for lang, body in blocks if lang in SHELL_BLOCKS
                   for x in body.replace("\\\n", " ").splitlines()]
    lines = [x for x in block_lines if COMMAND_START.match(x)]
    prose = re.sub(r"^ *```.*?^ *```", "", text, flags=re.M | re.S)
    for x in re.findall(r"`([^`\n]+)`", prose):
        if COMMAND_START.match(x):
            lines.append(x)
        elif PRODUCER_ALONE.match(x):
            lines.append(f"python -m producer {x}")
    return _commands(lines)


def runbook_commands() -> list[Command]:
    text = RUNBOOK.read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    assert blocks and all(lang in ("sh", "text") for lang, _ in blocks), \
        "every code block of the runbook is sh (commands) or text (what they print)"
    lines = [x for lang, body in blocks if lang == "sh" for x in body.splitlines()]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    lines += [x for x in re.findall(r"`([^`\n]+)`", prose) if COMMAND_START.match(x)]
    return _commands(lines)


def _commands(lines: list[str]) -> list[Command]:
    cmds = []
    for line in lines:
        for words in split_commands(line):
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words = words[1:]
            if words:
                cmds.append(Command(line.split("  #")[0].strip(), tuple(words)))
    return cmds

COMMANDS = runbook_commands()
DOC_COMMANDS = [c for page in DOC_PAGES for c in page_commands(page)]


def runnable(cmd: Command) -> bool:
    return cmd.kind in ("python -m producer", "python -m sglang_patch", "ops", "df") \
        and "/path/to/" not in cmd.line and "--help" not in cmd.argv \
        and cmd.line not in NOT_RUN

RUNNABLE = sorted({c.line for c in COMMANDS if runnable(c)})
