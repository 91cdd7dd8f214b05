"""Running ops/ scripts as a person does: bash in the repository, an environment without the
farm's variables (so a test sets exactly the ones it means).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the farm's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FARM_", "SGLANG_", "HSFARM_VLLM_"))
           and k not in ("REDIS_URL", "PYTHON")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return {**env, **extra}


def sh(*argv: str, env: dict[str, str], cwd: Path = ROOT,
       timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *argv], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s)
