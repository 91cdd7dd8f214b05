"""Test-only stand-ins, in plain torch, for what SGLang 0.5.23 lacks on a CPU without AMX.

NOT part of hsfarm and never installed: ``tests/live`` puts ``tests/sglang/cpu_kernel`` on the
live servers' ``PYTHONPATH``, where ``hsfarm_cpu_standins-0.0.0.dist-info`` declares this
package as an SGLang plugin (entry point group ``sglang.srt.plugins``). SGLang's own
``load_plugins()`` then calls ``load`` in every scheduler process, next to hsfarm's plugin.
Each stand-in replaces one kernel path, touches nothing else, and is checked on its own against
a straightforward torch implementation in ``tests/sglang/test_cpu_standins.py``:

- ``mla_attention``: the ``torch_native`` attention backend, with DeepSeek's prefix-free MHA
  prefill added (0.5.23's backend reads K/V from the pool, which for MLA holds the latent),
  and ``get_cpu_graph_seq_len_fill_value`` (DP attention's batch padding calls it; 0.5.23's
  torch_native backend lacks it).
- ``mm_processors.kimi_k25_text``: Kimi-K2.5's multimodal processor, text only (SGLang's needs
  Kimi's remote-code processor). Not a plugin hook: the tokenizer manager imports it when the
  Kimi server is started with ``SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE`` naming it.

SGLang's model code, its capture, ``LogitsProcessor`` and hsfarm's plugin run unchanged.
"""

from __future__ import annotations


def load() -> None:
    """SGLang plugin entry point: swap the stand-ins into SGLang's registries."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from hsfarm_cpu_standins.mla_attention import backend_class

    ATTENTION_BACKENDS["torch_native"] = backend_class()
