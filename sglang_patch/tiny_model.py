"""A tiny, randomly initialised Llama-style model and tokenizer, built locally with no download.

The reference server, the demo and the tests use it. It is deterministic (fixed seed, fixed
training text), so its config and tokenizer hashes, and with them the run fingerprint, are
the same on every machine with the same torch/transformers versions.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Llama-3-style chat template. Everything an assistant message adds after the generation
# prompt (its content and <|eot_id|>) is what the loss mask covers.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]
VERSION = "v2"  # v2: random norm weights

_TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. Hidden states are the activations of a model.
Speculative decoding drafts tokens with a small model and verifies them with a large one.
def extract(sample):\n    return model(sample.input_ids, output_hidden_states=True)\n
Le renard brun saute par-dessus le chien paresseux. Der schnelle braune Fuchs springt.
El zorro marrón salta sobre el perro perezoso. 快速的棕色狐狸跳过了懒狗。 素早い茶色の狐。
Быстрая коричневая лиса прыгает через ленивую собаку. The user asks; the assistant answers.
SELECT id, name FROM samples WHERE done = false ORDER BY id; for i in range(10): print(i)
"""


# The shape vLLM's CPU attention serves (head_dim 64; the default shape's 16 is not supported):
# the vLLM hook's live tests, with the same tokenizer.
VLLM_SHAPE = {"num_layers": 6, "hidden_size": 128, "num_heads": 2, "num_kv_heads": 1}


def tiny_model_dir(cache_dir: Path, seed: int = 0, shape: str = "") -> Path:
    suffix = (f"-{shape}" if shape else "") + (f"-seed{seed}" if seed else "")
    return cache_dir / f"tiny-llama-{VERSION}{suffix}"


def ensure_tiny_model(cache_dir: Path, num_layers: int = 8, hidden_size: int = 64,
                      seed: int = 0, num_heads: int = 4, num_kv_heads: int = 2) -> Path:
    """Build the tiny model once into ``cache_dir`` (atomically; safe with concurrent callers).

    ``seed`` draws other weights for the same config and tokenizer: a "fine-tune" of the same
    model, which a run must tell apart from the original. Attention heads other than the
    default 4 (2 KV) name the dir after the shape (``VLLM_SHAPE``: the vLLM hook's tests).
    """
    shape = "" if (num_heads, num_kv_heads) == (4, 2) else \
        f"l{num_layers}-h{hidden_size}-a{num_heads}-kv{num_kv_heads}"
    target = tiny_model_dir(cache_dir, seed, shape)
    if (target / "config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-build.", dir=cache_dir))
    try:
        _build(tmp, num_layers, hidden_size, seed, num_heads, num_kv_heads)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: theirs is identical
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(out: Path, num_layers: int, hidden_size: int, seed: int, num_heads: int,
           num_kv_heads: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=768,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=32768,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    # Random init gives near-zero activations; scale embeddings so hidden states are not
    # all within bf16 rounding of each other (tests compare values, not just shapes).
    # Norm weights are drawn too: with unit weights, applying the final RMSNorm once or twice
    # gives the same numbers, and no test could catch a pre-/post-norm mix-up.
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 2.0)
    model.save_pretrained(out, safe_serialization=True)
