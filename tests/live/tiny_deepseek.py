"""A tiny DeepSeek-V3-style model (MLA attention, a few MoE experts): Kimi-K2.5's code path.

``DeepseekV3ForCausalLM`` with random weights and the tiny Llama's tokenizer, built locally by
transformers. Its config carries the keys of the real DeepSeek-V3 / Kimi-K2 ``config.json``
that SGLang reads and transformers does not write (``moe_layer_freq``, ``topk_method``,
``scoring_func``, a yarn ``rope_scaling``: SGLang's CPU rotary embedding accepts only that).
What SGLang 0.5.23 can and cannot run with it on this CPU: ``docs/sglang-live.md``.

Its weights make every part of a layer count: transformers' default init (std 0.02) leaves
attention and MLP outputs at ~0.5% of the residual, under the live tests' 2% tolerance, so a
wrong attention, MoE or routing would still have matched. Here every matrix has std
``1/sqrt(fan_in)`` (each sublayer moves the residual by a sizeable fraction of its scale,
checked by ``test_live_deepseek.py``), the router's scores are spread out, the expert-choice
bias is not zero, the experts are picked in 2 groups, and ``routed_scaling_factor`` is not 1.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

VERSION = "v2"
LAYERS = 8  # SGLang's default capture ids [2, L//2, L-3] = [2, 4, 5]
_SGLANG_KEYS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                "ep_size": 1, "num_nextn_predict_layers": 0}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
         "rope_theta": 10000.0}


# vLLM's CPU MLA kernels compile only for DeepSeek's latent cache row (kv_lora_rank 512 +
# qk_rope_head_dim 64 = 576): the same model with those two sizes (tests/vllm/test_deepseek.py)
VLLM_LATENT = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def ensure_tiny_deepseek(cache_dir: Path, tokenizer_dir: Path, vllm_latent: bool = False
                         ) -> Path:
    """Build the model once into ``cache_dir`` (atomically); returns its directory.
    ``vllm_latent``: with ``VLLM_LATENT``'s sizes, in a directory of its own."""
    suffix = "-vllm" if vllm_latent else ""
    return _build_once(cache_dir / f"tiny-deepseek-v3-{VERSION}{suffix}",
                       lambda tmp: _build(tmp, tokenizer_dir,
                                          VLLM_LATENT if vllm_latent else {}))


def ensure_tiny_kimi(cache_dir: Path, tokenizer_dir: Path) -> Path:
    """Kimi-K2.5's wrapper (``KimiK25ForConditionalGeneration``) around the tiny DeepSeek-V3:
    the same language-model weights under ``language_model.``, so transformers' DeepSeek-V3
    forward of ``ensure_tiny_deepseek``'s checkpoint is its reference. Built once, atomically."""
    deepseek = ensure_tiny_deepseek(cache_dir, tokenizer_dir)
    return _build_once(cache_dir / f"tiny-kimi-k25-{VERSION}",
                       lambda tmp: _build_kimi(tmp, deepseek))


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``build`` into a temporary dir beside ``target``, then rename it into place; a
    concurrent builder's identical result wins the race harmlessly."""
    if (target / "config.json").exists():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-build.", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process built it meanwhile
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# A vision tower SGLang builds and never runs here (text only): the fields its 0.5.23 classes
# read. ``vt_hidden_size`` is read by ``K2VLMultiModalProjector`` and not set by SGLang's
# ``KimiK25VisionConfig``; Kimi-K2.5's own config.json carries it.
_KIMI_VISION = {"patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
                "init_pos_emb_time": 1, "num_attention_heads": 2, "num_hidden_layers": 1,
                "hidden_size": 32, "intermediate_size": 64, "merge_kernel_size": [2, 2],
                "mm_hidden_size": 32, "vt_hidden_size": 32, "text_hidden_size": 64}


def _build_kimi(out: Path, deepseek: Path) -> None:
    from safetensors.torch import load_file, save_file

    for p in deepseek.iterdir():
        if p.name not in ("config.json", "model.safetensors"):
            shutil.copy(p, out / p.name)
    text = json.loads((deepseek / "config.json").read_text())
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text, "vision_config": dict(_KIMI_VISION),
              "media_placeholder_token_id": text["pad_token_id"],
              **{k: text[k] for k in ("pad_token_id", "bos_token_id",
                                      "eos_token_id")}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # transformers' Kimi_K25Processor, which SGLang's tokenizer manager loads, needs these
    (out / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "Kimi_K25ImageProcessor"}))
    (out / "video_preprocessor_config.json").write_text(
        json.dumps({"video_processor_type": "Kimi_K25VideoProcessor"}))
    weights = load_file(str(deepseek / "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})


def _build(out: Path, tokenizer_dir: Path, sizes: dict[str, int] | None = None) -> None:
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4,
        **{"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 16, **(sizes or {})},
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=4096, rope_parameters=dict(_YARN),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 2.0)
            elif param.dim() >= 2 and "embed_tokens" not in name:  # the last dim is fan-in
                param.normal_(0.0, param.shape[-1] ** -0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    model.save_pretrained(out)
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update({**_SGLANG_KEYS, "rope_scaling": cfg["rope_parameters"]})
    path.write_text(json.dumps(cfg, indent=2))


def routing_margin(model: Any, ids: list[int]) -> float:
    """How clearly transformers routes ``ids``: over every MoE layer and token, the smallest
    gap in the router's choice score between a chosen and a rejected group, or between the
    last chosen and the first rejected expert of the chosen group. A server whose arithmetic
    differs by less than that picks the same experts for every token."""
    import torch

    gaps: list[float] = []

    def on_router(router: Any, inputs: tuple[Any, ...], _: Any) -> None:
        h = inputs[0].reshape(-1, router.hidden_dim).float()
        choice = torch.sigmoid(h @ router.weight.float().T) + router.e_score_correction_bias
        grouped = choice.view(len(h), router.num_group, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
        ranked = group_scores.sort(-1, descending=True)[0]
        if router.num_group > router.topk_group:
            gaps.append(float((ranked[:, router.topk_group - 1] - ranked[:, router.topk_group])
                              .min()))
        best = grouped[torch.arange(len(h)), group_scores.argmax(-1)]
        if router.topk_group == 1 and best.shape[-1] > router.top_k:
            by_score = best.sort(-1, descending=True)[0]
            gaps.append(float((by_score[:, router.top_k - 1] - by_score[:, router.top_k]).min()))

    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    handles = [r.register_forward_hook(on_router) for r in routers]
    try:
        with torch.inference_mode():
            model.model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return min(gaps)


def sublayer_shares(model: Any, ids: list[int]) -> list[tuple[float, float]]:
    """Per layer, the attention's and the MLP's output size relative to the residual stream
    entering the layer (per-token max abs, averaged over tokens)."""
    import torch

    sizes: dict[str, float] = {}

    def size_of(name: str) -> Any:
        def hook(_: Any, __: Any, out: Any) -> None:
            out = out[0] if isinstance(out, tuple) else out
            sizes[name] = float(out.abs().amax(-1).mean())
        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.register_forward_hook(size_of(f"attn{i}")))
        handles.append(layer.mlp.register_forward_hook(size_of(f"mlp{i}")))
    try:
        with torch.inference_mode():
            out = model.model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    shares = []
    for i in range(len(model.model.layers)):
        residual = float(out.hidden_states[i][0].abs().amax(-1).mean())
        shares.append((sizes[f"attn{i}"] / residual, sizes[f"mlp{i}"] / residual))
    return shares
