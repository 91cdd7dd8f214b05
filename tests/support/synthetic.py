"""The synthetic model both halves of test_synthetic use: Kimi-shaped, with a small hidden size.

One model dir in the shared cache (``ensure_synthetic_model``), so the unit tests and the farm
run read the same config.
"""

from __future__ import annotations

from sglang_patch.synthetic import SyntheticModel, ensure_synthetic_model
from tests.conftest import CACHE

H = 256


def synthetic_model(seed: int = 0) -> SyntheticModel:
    return SyntheticModel(ensure_synthetic_model(CACHE, H, 61), seed=seed)
