"""``adopt``'s diagnosis of a mismatch: a source whose last layer holds the state before the
final norm is named "pre-norm"; a file written only with the states its check pinned; fp8 files
kept out of a bf16 run. Arrays, the comparison and a store on a temp dir; no server or Redis.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine_dump.dumpfile import DTYPE_BF16, DTYPE_FP8, is_temp_name
from engine_dump.fingerprint import Fingerprint
from producer.adopt import check as ck
from producer.adopt import match as am
from producer.adopt import pin as pn
from producer.adopt.formats import SourceSample
from producer.adopt.write import write_adopted
from worker.core import canary as cn
from worker.core import store as st
from worker.core.errors import SourceFileRefused

N_DATA, N_SOURCE = 8, 6
FP = Fingerprint(config_sha256="x", tokenizer_sha256="x", chat_template_sha256="x",
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


def _store(tmp_path: Path, dtype: str) -> st.OutputStore:
    fp = replace(FP, hidden_size=8, dtype=dtype)
    return st.OutputStore(tmp_path / dtype, fp).open()


def _sample(n: int = 6, h: int = 8) -> SourceSample:
    rng = np.random.default_rng(0)
    bits = cn._to_bf16(rng.normal(size=(n, 4 * h)).astype(np.float32))
    return SourceSample(np.arange(n, dtype=np.int64), None, bits[:, 3 * h:].copy(),
                        bits[:, :3 * h].copy(), DTYPE_BF16)


@pytest.mark.parametrize("dtype", [DTYPE_BF16, DTYPE_FP8])
def test_a_file_is_written_only_with_the_states_its_check_pinned(tmp_path: Path,
                                                                  dtype: str) -> None:
    # Given a source file's states pinned by its check, and a run storing bf16 or fp8
    store, s = _store(tmp_path, dtype), _sample()
    pin, _ = pn.take(s, np.array([0, 5]))
    mask = np.ones(6, dtype=np.int64)
    # When its aux states differ at write time from those checked (one bit)
    s.aux[3, 7] ^= 1
    # Then it is refused as changed, and nothing is at its final path
    with pytest.raises(SourceFileRefused, match="changed since it was checked"):
        write_adopted(store, "k", "h", s, mask, {}, pin=pin)
    assert not store.final_path("k").exists()
    assert not [p for p in tmp_path.rglob("*") if is_temp_name(p.name)]
    # And the states checked are written
    s.aux[3, 7] ^= 1
    write_adopted(store, "k", "h", s, mask, {}, pin=pin)
    assert store.final_path("k").exists()


def test_fp8_files_are_refused_by_a_bf16_run() -> None:
    s = _sample()
    s.dtype = DTYPE_FP8
    with pytest.raises(SourceFileRefused, match="this run stores bfloat16"):
        am.check_shapes(s, replace(FP, hidden_size=8))
