"""Every option of the long-running commands says what it does in its help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_every_option_of_the_long_commands_says_what_it_does() -> None:
    import argparse

    from producer.cli import build_parser

    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name in ("adopt", "audit", "demo", "enqueue", "export"):
        silent = [a.option_strings for a in sub.choices[name]._actions
                  if a.option_strings and a.dest != "help" and not a.help]
        assert not silent, (name, silent)


def test_the_producer_run_outside_the_farms_venv_names_the_venv_to_use(tmp_path: Path) -> None:
    # Given a python without the farm's libraries (a bare venv: no redis, no celery)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
                   check=True, timeout=120)
    bare = tmp_path / "bare" / "bin" / "python"
    root = Path(__file__).resolve().parents[2]
    # When a person runs a producer command with it, from the checkout
    res = subprocess.run([str(bare), "-m", "producer", "status"], capture_output=True,
                         text=True, timeout=120, cwd=root,
                         env={"PATH": os.environ["PATH"], "PYTHONPATH": str(root)})
    # Then it exits 2 with one line: what is missing, in which python, and what to do
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("error: ") and f"in this python ({bare})" in res.stderr
    assert ". /opt/hsfarm/.venv/bin/activate" in res.stderr
    assert "pip install 'hsfarm[worker]'" in res.stderr
