"""CLI exit codes and messages when the surroundings are wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from producer.localfarm.farm import free_port
from worker.core.settings import Settings
from worker.core.store import OutputStore
from worker.server.fingerprint import compute_fingerprint


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FARM_") and k != "REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "producer", *args], env={**base, **env},
                          capture_output=True, text=True, timeout=120)


def test_unreachable_redis_is_a_clear_error(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"  # a run's output dir (its manifest), as the first worker writes it
    OutputStore(out, compute_fingerprint(Settings(), tiny_model)).open()
    res = _run(["status"], REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
               FARM_MODEL_PATH=str(tiny_model), FARM_OUTPUT_DIR=str(out))
    assert res.returncode == 2
    assert "did not answer" in res.stderr and "Traceback" not in res.stderr


def test_unreachable_server_without_model_path(tmp_path: Path) -> None:
    res = _run(["enqueue", str(tmp_path / "x.json")],
               FARM_SERVER_URL=f"http://127.0.0.1:{free_port()}")
    assert res.returncode == 2
    assert "start it first or set FARM_MODEL_PATH" in res.stderr


def test_bad_setting_names_the_variable(tmp_path: Path) -> None:
    res = _run(["settings"], FARM_MAX_TOKENS="lots")
    assert res.returncode == 2 and "FARM_MAX_TOKENS='lots'" in res.stderr
