"""Tests run by each trainer's own venv (.venv-specforge, .venv-modelopt, .venv-speculators).

Those venvs have the trainer, torch and safetensors, and ``hsfarm[training]`` installed beside
it as a user would (no Celery, Redis or the farm's transformers): the data comes from
``make trainer-data`` (``python -m tests.support.training_data``), real farm output of the tiny
model, exported to every trainer's container by the farm's export. Our own files are read here with
safetensors alone, so "ours" is what the farm wrote, not what our loader says.
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
    """Every sample the farm wrote, by key: its tensors as torch loads them (an fp8 run's
    hidden states as bf16: e4m3 times its scale per token and layer, the stored format's
    definition, computed here without our code)."""
    from safetensors.torch import load_file

    out = {}
    for p in sorted((data / "out" / "samples").rglob("*.safetensors")):
        out[p.name[: -len(".safetensors")]] = _bf16(load_file(str(p)))
    return out


def _bf16(t: dict[str, Any]) -> dict[str, Any]:
    import torch

    for name in ("hidden_state", "aux_hidden_state"):
        scale = t.pop(f"{name}_scale", None)
        if scale is not None:
            n, layers = scale.shape
            values = t[name].float().view(n, layers, -1) * scale[:, :, None]
            t[name] = values.view(n, -1).to(torch.bfloat16)
    return t


def manifest(data: Path) -> dict[str, Any]:
    return dict(json.loads((data / "out" / "manifest.json").read_text()))


def training_extra_changes() -> dict[str, tuple[str | None, str]]:
    """What ``pip install <this project>[training]`` would change in this venv: name ->
    (installed version or None, version pip would install), from pip's own resolver
    (``--dry-run --report``), nothing installed. Always holds ``hsfarm`` itself."""
    import importlib.metadata as md
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "-q",
                          "--report", "-", f"{ROOT}[training]"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict[str, tuple[str | None, str]] = {}
    for item in json.loads(res.stdout)["install"]:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        try:
            before: str | None = md.version(name)
        except md.PackageNotFoundError:
            before = None
        if before != version or name == "hsfarm":
            out[name.lower()] = (before, version)
    return out


def assert_training_extra_keeps(pins: dict[str, str]) -> None:
    """``hsfarm[training]`` installs beside this trainer without touching ``pins`` (name ->
    the trainer's requirement, which the version installed here meets)."""
    import importlib.metadata as md

    from packaging.specifiers import SpecifierSet

    for name, spec in pins.items():  # the venv is the trainer's, as it pins it
        assert md.version(name) in SpecifierSet(spec), (name, md.version(name), spec)
    changes = training_extra_changes()
    assert "hsfarm" in changes  # pip did resolve our project
    assert not {n: changes[n] for n in pins if n in changes}, changes


def assert_in_place_equals_export(data: Path, view: str,
                                  exported: dict[str, dict[str, Any]]) -> None:
    """hsfarm[training]'s loader, in this trainer's venv, reads our files in place in this
    trainer's view: every sample equals its export (``exported``: key -> its tensors as the
    trainer loads them), tensor for tensor."""
    import torch

    from training.loader import HiddenStates

    ds = HiddenStates(data / "out", view=view)
    assert sorted(ds.keys) == sorted(exported)
    for i, key in enumerate(ds.keys):
        item = ds[i]
        for name, want in exported[key].items():
            if isinstance(want, torch.Tensor):
                assert torch.equal(item[name], want), (key, name)
