"""Headless Debian Chromium on a page of the farm (the dashboard, Flower): its DOM once the
page's scripts ran, or a screenshot. The test is skipped, saying so, where it is missing."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def chromium(url: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on ``url`` with a fresh profile under ``out``; ``args``:
    --dump-dom, --screenshot=PATH, --window-size=W,H."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("chromium is not installed (make test-system-deps installs Debian's chromium)")
    profile = tempfile.mkdtemp(dir=out, prefix="chromium-")
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                           "--virtual-time-budget=10000", *args, url],
                          capture_output=True, text=True, timeout=120)
