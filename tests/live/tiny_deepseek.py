"""A tiny DeepSeek-V3-style model (MLA attention, a few MoE experts): Kimi-K2.5's code path.

``DeepseekV3ForCausalLM`` with random weights and the tiny Llama's tokenizer, built locally by
transformers. Its config carries the keys of the real DeepSeek-V3 / Kimi-K2 ``config.json``
that SGLang reads and transformers does not write (``moe_layer_freq``, ``topk_method``,
``scoring_func``, a yarn ``rope_scaling``: SGLang's CPU rotary embedding accepts only that).
What SGLang 0.5.23 can and cannot run with it on this CPU: ``docs/sglang-live.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

VERSION = "v1"
LAYERS = 8  # SGLang's default capture ids [2, L//2, L-3] = [2, 4, 5]
_SGLANG_KEYS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                "ep_size": 1, "num_nextn_predict_layers": 0}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
         "rope_theta": 10000.0}


def ensure_tiny_deepseek(cache_dir: Path, tokenizer_dir: Path) -> Path:
    """Build the model once into ``cache_dir`` (atomically); returns its directory."""
    target = cache_dir / f"tiny-deepseek-v3-{VERSION}"
    if (target / "config.json").exists():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-ds-build.", dir=cache_dir))
    try:
        _build(tmp, tokenizer_dir)
        try:
            os.rename(tmp, target)
        except OSError:  # another process built it meanwhile
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(out: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, max_position_embeddings=4096, rope_parameters=dict(_YARN),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # as the tiny Llama: activations that bf16 can tell apart
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 2.0)
    model.save_pretrained(out)
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update({**_SGLANG_KEYS, "rope_scaling": cfg["rope_parameters"]})
    path.write_text(json.dumps(cfg, indent=2))
