"""``adopt``'s diagnosis of a mismatch: a source whose last layer holds the state before the
final norm is named "pre-norm". Arrays and the comparison only; no server or Redis.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine_dump import contracts as c
from producer.adopt import check as ck
from worker.core import canary as cn

N_DATA, N_SOURCE = 8, 6
FP = c.Fingerprint(config_sha256="x", tokenizer_sha256="x", chat_template_sha256="x",
                   layers_to_capture=(2, 4, 5), layer_convention="x", hidden_size=64,
                   dtype="bfloat16", max_tokens=8192, overlong="reject")


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
