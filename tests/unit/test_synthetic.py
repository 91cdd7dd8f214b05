"""The synthetic server mode's model: a Kimi-shaped model dir without weights, values that depend
on token and position only, and a pooled buffer never reused while a dump part points into it.
"""

from __future__ import annotations

import gc
import json

import torch

from sglang_patch.synthetic import (
    BufferPool,
    PooledStager,
    SyntheticModel,
    ensure_synthetic_model,
)
from tests.conftest import CACHE
from tests.support.synthetic import H, synthetic_model


def test_the_model_dir_is_kimi_like_and_needs_no_weights() -> None:
    path = ensure_synthetic_model(CACHE, 7168, 61)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (7168, 61)
    assert (path / "tokenizer.json").exists() and (path / "chat_template.jinja").exists()
    assert not list(path.glob("*.safetensors"))
    assert SyntheticModel(path).layers_to_capture == (2, 30, 58)


def test_values_depend_on_token_and_position_only() -> None:
    m, again = synthetic_model(), synthetic_model()
    ids = [5, 7, 5, 9, 11, 13]
    hidden, aux = m.rows(ids, range(6))
    # deterministic across instances, finite, and different for the same token elsewhere
    assert torch.equal(hidden, again.rows(ids, range(6))[0])
    assert hidden.shape == (6, H) and aux.shape == (6, 3 * H) and hidden.dtype == torch.bfloat16
    assert torch.isfinite(aux.float()).all()
    assert not torch.equal(hidden[0], hidden[2])
    assert not torch.equal(synthetic_model(seed=1).rows(ids, range(6))[0], hidden)
    # a batch of chunks at their prefixes gives the same rows as the whole request
    out = m.forward_batch([(ids[:4], 0), ([1, 2], 0), (ids[4:], 4)])
    assert torch.equal(out.hidden[:4], hidden[:4]) and torch.equal(out.hidden[6:], hidden[4:])
    assert torch.equal(out.aux[:4], aux[:4]) and torch.equal(out.aux[6:], aux[4:])


def test_a_pooled_buffer_is_not_reused_while_a_dump_part_points_into_it() -> None:
    # Given a forward pass into pooled buffers, with a part of it staged for the writer
    m = synthetic_model()
    stager = PooledStager(m.pool)
    out = m.forward_batch([([1, 2, 3], 0)])
    staged = stager.stage([out.ids[:3], out.hidden[:3], out.aux[:3]])
    expected = out.hidden[:3].clone()
    buf = out.hidden.untyped_storage().data_ptr()
    del out
    gc.collect()
    # When more passes run
    for i in range(3):
        later = m.forward_batch([([40 + i] * 3, 0)])
        assert later.hidden.untyped_storage().data_ptr() != buf
        del later
    # Then the staged rows are intact, and once the part is dropped its buffer is reused
    assert torch.equal(staged.wait()[1], expected)
    del staged
    gc.collect()
    assert any(m.forward_batch([([1], 0)]).hidden.untyped_storage().data_ptr() == buf
               for _ in range(2))
    assert isinstance(m.pool, BufferPool)
