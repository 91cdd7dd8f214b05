"""The project builds without setuptools' warnings, and an installed (non-editable) copy holds
the dashboard's static files where the dashboard looks for them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.timeout(300)
def test_the_wheel_builds_quietly_and_its_dashboard_finds_its_files(tmp_path: Path) -> None:
    # Given the project built into a wheel, as pip install does
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                          "--no-build-isolation", "-v", "-w", str(tmp_path / "dist")],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    # Then setuptools warns of no package left out of the configuration
    said = res.stdout + res.stderr
    assert "is absent from the `packages` configuration" not in said, said
    # When the wheel is unpacked as an install would lay it out
    [wheel] = (tmp_path / "dist").glob("hsfarm-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Then the dashboard imported from it serves every static file it names
    check = ("import sys, producer.dashboard.server as d; "
             "assert d.__file__.startswith(sys.argv[1]), d.__file__; "
             "names = [*d.STATIC_FILES, 'dashboard.html']; "
             "missing = [n for n in names if not (d.STATIC / n).is_file()]; "
             "assert not missing, missing")
    res = subprocess.run([sys.executable, "-c", check, str(site)], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stdout + res.stderr
