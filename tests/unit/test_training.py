"""The training side's own arithmetic: the final norm found in a checkpoint (or said missing),
a torn export-ledger line dropped, specforge's draft-vocab mapping, bf16 rounding and the
pre-norm state against torch. No farm, no Celery.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from training.export.ledger import NAME as LEDGER
from training.export.runner import export
from worker.core.errors import ConfigError
from worker.core.final_norm import pick_final_norm
from worker.core.store import OutputStore


def test_final_norm_is_found_in_nested_and_other_checkpoints() -> None:
    kimi = ["language_model.model.norm.weight", "language_model.lm_head.weight",
            "language_model.model.layers.3.input_layernorm.weight",
            "vision_tower.encoder.final_layernorm.weight", "mm_projector.pre_norm.weight"]
    assert pick_final_norm(kimi) == "language_model.model.norm.weight"
    assert pick_final_norm(["transformer.ln_f.weight", "transformer.h.0.ln_1.weight"]) == \
        "transformer.ln_f.weight"
    with pytest.raises(ConfigError, match="cannot tell"):
        pick_final_norm(["model.layers.0.input_layernorm.weight"])


def test_a_model_without_a_findable_final_norm_still_runs_and_speculators_says_why(
        tmp_path: Path) -> None:
    # Given a model dir with a config but no safetensors weights, and a store opened with it
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fp = Fingerprint(config_sha256="a", tokenizer_sha256="b", chat_template_sha256="c",
                     layers_to_capture=(2, 4, 5), layer_convention=LAYER_CONVENTION,
                     hidden_size=4, dtype="bfloat16", max_tokens=64, overlong="reject")
    OutputStore(tmp_path / "out", fp, model_path=model).open()
    # Then the manifest says why there is no final norm
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "model.safetensors" in m["final_norm"]["error"]
    # And only the export that needs it refuses, with that reason
    with pytest.raises(ConfigError, match=r"final_norm.safetensors is missing \(.*model"):
        export(tmp_path / "out", "speculators", tmp_path / "sp")
    assert export(tmp_path / "out", "specforge", tmp_path / "sf").ok


def test_a_torn_ledger_line_is_dropped(tmp_path: Path) -> None:
    from training.export.ledger import Ledger

    # Given a ledger whose last line a crash cut short
    (tmp_path / LEDGER).write_bytes(b'{"key": "a", "path": "x"}\n{"key": "b", "pa')
    # When it is opened, Then the whole entries stay and the torn tail is gone from the file
    ledger = Ledger(tmp_path)
    assert list(ledger.entries) == ["a"]
    assert (tmp_path / LEDGER).read_bytes() == b'{"key": "a", "path": "x"}\n'
    ledger.add({"key": "c", "path": "y"})
    assert list(Ledger(tmp_path).entries) == ["a", "c"]


def test_draft_vocab_mapping_is_specforges_top_n() -> None:
    from training.vocab import draft_vocab_mapping

    # Given counts where token 7 is most frequent, 3 next, and 5 and 9 tie
    counts = np.zeros(12, np.int64)
    counts[[7, 3, 5, 9]] = [10, 5, 2, 2]
    # When the top 3 are taken, Then ties go to the lower id; d2t is the offset to the target id
    d2t, t2d = draft_vocab_mapping(counts, 3, 12)
    assert list(np.flatnonzero(t2d)) == [3, 5, 7] and list(d2t) == [3, 4, 5]
    # And with fewer seen tokens than the draft size, the lowest unseen ids fill up
    d2t, t2d = draft_vocab_mapping(counts, 6, 12)
    assert list(np.flatnonzero(t2d)) == [0, 1, 3, 5, 7, 9]
    with pytest.raises(ValueError, match="outside the target vocab"):
        draft_vocab_mapping(counts, 3, 8)


def test_bf16_rounding_and_the_prenorm_state_equal_torchs() -> None:
    """training.prenorm rounds in place for speed; the bits must still be torch's."""
    from training.prenorm import f32_to_bf16, prenorm_bf16

    def bf16_bits(t: torch.Tensor) -> np.ndarray:
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    rng = np.random.default_rng(0)
    y = (rng.normal(size=(64, 512)) * 10).astype(np.float32)
    # ties to even (down and up), the largest float, infinities, signed zeros, and a NaN
    y[0, :9] = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F800000,
                         0xFF800000, 0, 0x80000000, 0x7FC00000], np.uint32).view(np.float32)
    before = y.copy()
    got = f32_to_bf16(y)
    assert np.array_equal(y, before, equal_nan=True)  # the input is left alone
    finite = ~np.isnan(y)
    assert np.array_equal(got[finite], bf16_bits(torch.from_numpy(y))[finite])
    assert got[0, 8] == 0x7FC0  # NaN stays a NaN
    # The pre-norm state: hidden / w in float32, rounded; 0 where w is 0
    hidden = bf16_bits(torch.from_numpy(rng.normal(size=(64, 512)).astype(np.float32)))
    w = rng.uniform(0.5, 2.0, 512).astype(np.float32)
    w[[3, 100]] = 0
    x = torch.from_numpy(hidden.view(np.int16)).view(torch.bfloat16).float()
    wt = torch.from_numpy(w)
    want = bf16_bits(torch.where(wt == 0, 0.0, x / torch.where(wt == 0, 1.0, wt)))
    assert np.array_equal(prenorm_bf16(hidden, w), want)
