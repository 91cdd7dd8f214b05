"""``adopt``: files of earlier runs, written by the reference model in each format, taken into
a run only when the live server reproduces them; damaged and hostile ones refused one by one.

One Redis and one reference server for the module; each test its own output dir (a run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from producer.adopt import check as ck
from producer.localfarm.farm import LocalFarm
from sglang_patch import contracts as c
from tests.conftest import EXAMPLES, served_farm
from worker.core import canary as cn

N_DATA, N_SOURCE = 8, 6
FP = c.Fingerprint(config_sha256="x", tokenizer_sha256="x", chat_template_sha256="x",
                   layers_to_capture=(2, 4, 5), layer_convention="x", hidden_size=64,
                   dtype="bfloat16", max_tokens=8192, overlong="reject")


@pytest.fixture(scope="module")
def farm(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalFarm]:
    with served_farm(tmp_path_factory.mktemp("adopt") / "farm", chunked_prefill_size=64) as f:
        yield f


@pytest.fixture(scope="module")
def data(farm: LocalFarm) -> tuple[Path, list[dict[str, Any]]]:
    records = json.loads(EXAMPLES.read_text())[:N_DATA]
    path = farm.work_dir / "data.json"
    path.write_text(json.dumps(records))
    return path, records


def adopt(farm: LocalFarm, source: Path, data: Path, out: Path, *args: str,
          wait: bool = True) -> Any:
    """``python -m producer adopt`` into the run of ``out`` (torch importable)."""
    argv = [sys.executable, "-m", "producer", "adopt", str(source), "--data", str(data),
            "--no-progress", "--seed", "1", *args]
    env = {**farm.env(), "FARM_OUTPUT_DIR": str(out)}
    if not wait:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def test_pre_norm_final_state_diagnosed() -> None:
    rng = np.random.default_rng(0)
    h = 16
    w = rng.uniform(0.5, 2.0, h)
    pre = [rng.normal(size=(4, 5, h)) for _ in range(2)]
    post = [np.concatenate([p[:3], (p[3] / np.sqrt((p[3] ** 2).mean(-1, keepdims=True)
                                                   + 1e-6) * w)[None]]) for p in pre]
    recorded = [cn.Canary(np.arange(5), np.arange(5), p) for p in pre]
    names = cn.layer_names((2, 4, 5))
    cmp = cn.compare(recorded, post, names, 0.01, 0.0025)
    assert not cmp.passed
    fp = replace(FP, layers_to_capture=(2, 4, 5), hidden_size=h)
    assert "pre-norm" in ck.diagnose(cmp, recorded, post, fp, lambda x: x / np.sqrt(
        (x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w)
    assert "final state alone differs" in ck.diagnose(cmp, recorded, post, fp, None)
