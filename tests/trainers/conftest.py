"""Tests run by each trainer's own venv (.venv-specforge, .venv-modelopt, .venv-speculators).

Those venvs have the trainer, torch and safetensors, and none of the farm: the data comes
from ``make trainer-data`` (``python -m tests.training_data``), real farm output of the tiny
model, exported to every trainer's container by ``python -m producer export``. Our own files
are read here with safetensors alone, so "ours" is what the farm wrote, not what our loader
says.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("HSFARM_TRAINER_DATA", ROOT / ".trainer-data"))


@pytest.fixture(scope="session")
def data() -> Path:
    if not (DATA / ".complete").exists():
        pytest.fail(f"no trainer data in {DATA}: run `make trainer-data` first")
    return DATA


def ours(data: Path) -> dict[str, dict[str, Any]]:
    """Every sample the farm wrote, by key: its tensors as torch loads them."""
    from safetensors.torch import load_file

    out = {}
    for p in sorted((data / "out" / "samples").rglob("*.safetensors")):
        out[p.name[: -len(".safetensors")]] = load_file(str(p))
    return out


def manifest(data: Path) -> dict[str, Any]:
    return dict(json.loads((data / "out" / "manifest.json").read_text()))
