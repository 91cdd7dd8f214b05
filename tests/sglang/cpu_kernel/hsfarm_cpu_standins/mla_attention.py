"""MLA prefill on ``torch_native``: attention over the K/V the model hands over, not the pool's.

SGLang's DeepSeek prefill without a cached prefix (``AttnForwardMethod.MHA``, which the
``triton`` handler picks for ``torch_native``: ``models/deepseek_common/
attention_backend_handler.py`` ``handle_attention_triton``) writes the compressed latent into
the KV pool itself, expands it to full per-head K/V with ``kv_b_proj`` and calls the backend
with ``save_kv_cache=False`` (``forward_mha.py`` ``forward_normal_core``). A GPU backend's
extend kernel attends over those K/V; 0.5.23's ``TorchNativeAttnBackend.forward_extend``
always reads K/V from the pool, which for MLA holds the 1-head latent, so SDPA fails on the
shapes. This backend attends over the given K/V in exactly that case and leaves every other
call (the absorbed MLA path of later chunks, decode, every non-MLA model) to ``torch_native``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

log = logging.getLogger("hsfarm.cpu_standins")


def causal_attention_over_new_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 extend_lens: list[int], scaling: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its own new tokens only.

    ``q``/``k`` [T, heads, d_qk], ``v`` [T, heads, d_v], the requests' rows back to back
    (``extend_lens``); returns [T, heads, d_v] in ``q``'s dtype.
    """
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    start = 0
    for n in extend_lens:
        rows = slice(start, start + n)
        # [n, heads, d] -> [heads, n, d], the layout SDPA batches over
        qh, kh, vh = (t[rows].movedim(0, 1) for t in (q, k, v))
        o = scaled_dot_product_attention(qh.unsqueeze(0), kh.unsqueeze(0).to(qh.dtype),
                                         vh.unsqueeze(0).to(qh.dtype), is_causal=True,
                                         scale=scaling)
        out[rows] = o.squeeze(0).movedim(0, 1)
        start += n
    return out


def backend_class() -> type:
    """``TorchNativeAttnBackend`` with the MHA prefill of MLA models added (imports SGLang)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class TorchNativeMLAPrefillBackend(TorchNativeAttnBackend):
        used = False  # logged once per process, when SGLang's logging is set up

        def get_cpu_graph_seq_len_fill_value(self) -> int:
            """What DP attention pads ``seq_lens`` with on CPU
            (``ForwardBatch._pad_inputs_to_size``); 0.5.23's torch_native lacks it. The value
            of SGLang's CPU backend, ``intel_amx_backend.py``."""
            return 1

        def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                           save_kv_cache: bool = True, **kwargs: Any) -> Any:
            if save_kv_cache or k is None or v is None or kwargs:
                return super().forward_extend(q, k, v, layer, forward_batch,
                                              save_kv_cache=save_kv_cache, **kwargs)
            # The model keeps the cache itself and passes K/V of the new tokens only: the
            # triton handler does so only when no request of the batch has a cached prefix.
            prefix = forward_batch.extend_prefix_lens_cpu
            if prefix is None or any(prefix):
                raise NotImplementedError(
                    "hsfarm CPU stand-in: K/V given for a batch with cached prefixes "
                    f"{prefix}; only the prefix-free MHA prefill is stood in for")
            if not TorchNativeMLAPrefillBackend.used:
                TorchNativeMLAPrefillBackend.used = True
                log.warning("hsfarm test-only CPU stand-in in use: MLA prefill attention over "
                            "the model's own K/V (tests/sglang/cpu_kernel)")
            heads = layer.tp_q_head_num
            o = causal_attention_over_new_kv(
                q.view(-1, heads, layer.qk_head_dim), k.view(-1, layer.tp_k_head_num,
                                                             layer.qk_head_dim),
                v.view(-1, layer.tp_v_head_num, layer.v_head_dim),
                list(forward_batch.extend_seq_lens_cpu), layer.scaling)
            return o.reshape(-1, heads * layer.v_head_dim)

    return TorchNativeMLAPrefillBackend
