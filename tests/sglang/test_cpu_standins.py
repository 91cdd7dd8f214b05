"""The live servers' test-only CPU stand-ins (``cpu_kernel/hsfarm_cpu_standins``), each
against a straightforward torch implementation, and loaded the way the live servers load them.

The live DeepSeek tests compare whole models with transformers; these pin each stand-in down on
its own, so that a wrong stand-in cannot hide behind (or be blamed for) the model comparison.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

CPU_KERNEL = Path(__file__).parent / "cpu_kernel"


@pytest.fixture(scope="module")
def standins() -> Iterator[ModuleType]:
    """The stand-in package, imported from the live servers' PYTHONPATH entry; only it (that
    entry also holds the ``sgl_kernel`` stand-in, which this process must not pick up)."""
    sys.path.insert(0, str(CPU_KERNEL))
    try:
        importlib.import_module("hsfarm_cpu_standins")
        yield importlib.import_module("hsfarm_cpu_standins.mla_attention")
    finally:
        sys.path.remove(str(CPU_KERNEL))


def plain_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           extend_lens: list[int], scaling: float) -> torch.Tensor:
    """softmax(q k^T * scale, causal) v, one request, head and query row at a time, float64."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    start = 0
    for n in extend_lens:
        for h in range(q.shape[1]):
            for i in range(n):
                qi = q[start + i, h].double()
                keys = k[start : start + i + 1, h].double()
                w = torch.softmax(keys @ qi * scaling, dim=0)
                out[start + i, h] = w @ v[start : start + i + 1, h].double()
        start += n
    return out


def _mla_inputs(lens: list[int], heads: int = 4, d_qk: int = 24,
                d_v: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = sum(lens)
    return (torch.randn(t, heads, d_qk, generator=g), torch.randn(t, heads, d_qk, generator=g),
            torch.randn(t, heads, d_v, generator=g))


def test_mla_prefill_attention_equals_plain_causal_attention(standins: ModuleType) -> None:
    # Given three requests back to back (one of a single token), DeepSeek's MHA-prefill shapes
    # (q/k head dim nope 16 + rope 8, v head dim 16) and a yarn-style scale
    lens = [5, 1, 9]
    q, k, v = _mla_inputs(lens)
    scale = 1.3 / math.sqrt(24)
    # When the stand-in attends
    got = standins.causal_attention_over_new_kv(q, k, v, lens, scale)
    # Then each request's rows attend causally over its own rows only
    want = plain_causal_attention(q, k, v, lens, scale)
    assert got.shape == (15, 4, 16)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # (and a request that saw the others' rows would differ: the check can fail)
    merged = plain_causal_attention(q, k, v, [15], scale)
    assert (merged[5:] - want[5:]).abs().max() > 0.1


def _layer(heads: int = 4) -> Any:
    return SimpleNamespace(tp_q_head_num=heads, tp_k_head_num=heads, tp_v_head_num=heads,
                           qk_head_dim=24, v_head_dim=16, scaling=0.2)


def test_the_backend_uses_the_given_kv_only_for_the_models_own_cache(
        standins: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    cls = standins.backend_class()
    assert issubclass(cls, TorchNativeAttnBackend)
    backend = cls.__new__(cls)  # no ModelRunner here: forward_extend needs none of its state
    lens = [3, 4]
    q, k, v = _mla_inputs(lens)
    batch = SimpleNamespace(extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[0, 0])
    pool_reads: list[bool] = []
    monkeypatch.setattr(TorchNativeAttnBackend, "forward_extend",
                        lambda *a, **kw: pool_reads.append(kw["save_kv_cache"]))
    # When the model keeps the cache itself (save_kv_cache=False) on a prefix-free batch
    o = backend.forward_extend(q.reshape(7, -1), k, v, _layer(), batch, save_kv_cache=False)
    # Then the output is causal attention over the given K/V, flattened as SGLang expects
    want = plain_causal_attention(q, k, v, lens, 0.2).reshape(7, 64)
    torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-5)
    assert pool_reads == []
    # And every other call is torch_native's own (it writes and reads the pool)
    backend.forward_extend(q.reshape(7, -1), k, v, _layer(), batch, save_kv_cache=True)
    assert pool_reads == [True]
    # And DP attention's padding finds the seq_lens fill value of SGLang's CPU backend
    assert backend.get_cpu_graph_seq_len_fill_value() == 1
    # And a batch with a cached prefix is refused rather than attended without its prefix
    batch.extend_prefix_lens_cpu = [0, 2]
    with pytest.raises(NotImplementedError, match="cached prefixes"):
        backend.forward_extend(q.reshape(7, -1), k, v, _layer(), batch, save_kv_cache=False)


def test_the_plugin_entry_point_registers_the_backend(standins: ModuleType) -> None:
    # Given the stand-ins' dist-info on the path, as on a live server's PYTHONPATH
    from importlib.metadata import entry_points

    sys.path.insert(0, str(CPU_KERNEL))
    try:
        [ep] = [e for e in entry_points(group="sglang.srt.plugins")
                if e.name == "hsfarm_cpu_standins"]
    finally:
        sys.path.remove(str(CPU_KERNEL))
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    before = ATTENTION_BACKENDS["torch_native"]
    try:
        # When SGLang's plugin loader would call it
        ep.load()()
        # Then torch_native builds the stand-in backend
        assert ATTENTION_BACKENDS["torch_native"].__name__ == "TorchNativeMLAPrefillBackend"
    finally:
        ATTENTION_BACKENDS["torch_native"] = before


def test_the_kimi_text_only_processor_registers_and_refuses_media(standins: ModuleType) -> None:
    import asyncio

    from sglang.srt.managers import multimodal_processor as mp
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

    saved = dict(mp.PROCESSOR_MAPPING)
    try:
        # When SGLang's tokenizer manager imports the package named by
        # SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE (overwriting its own processors)
        mp.import_processors("sglang.srt.multimodal.processors")
        mp.import_processors("hsfarm_cpu_standins.mm_processors", overwrite=True)
        # Then Kimi-K2.5's architecture gets the text-only stand-in
        [cls] = [p for m, p in mp.PROCESSOR_MAPPING.items()
                 if m.__name__ == KimiK25ForConditionalGeneration.__name__]
        assert cls.__name__ == "KimiK25TextOnlyProcessor"
        # And a request with media is refused, never silently dropped
        processor = cls.__new__(cls)
        with pytest.raises(NotImplementedError, match="text requests only"):
            asyncio.run(processor.process_mm_data_async([b"image"], "text", None))
    finally:
        mp.PROCESSOR_MAPPING.clear()
        mp.PROCESSOR_MAPPING.update(saved)
