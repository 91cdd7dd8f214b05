"""A transformers causal LM run the way SGLang runs it for extraction: chunk by chunk.

Each request keeps its own KV cache between chunks, so a long prompt split into pieces gives
the same hidden states as one forward pass. Captured per token:
- the aux states with SGLang's convention (``hidden_states[i]`` = the input of layer i), and
- the final post-norm hidden state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_dump.dumpfile import AUX_LAYERS
from engine_dump.fingerprint import default_layers_to_capture


@dataclass
class ChunkOutput:
    hidden: torch.Tensor  # [t, H] final, post-norm
    aux: torch.Tensor  # [t, 3H] the capture layers, concatenated in order
    next_token: int  # argmax after the chunk's last position
    logits: torch.Tensor | None = None  # [V] float32, after the chunk's last position


class ReferenceModel:
    """Loads a Hugging Face causal LM and runs prefill chunks with per-request caches."""

    def __init__(
        self,
        model_path: Path,
        layers_to_capture: tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
        threads: int | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.model_path = model_path
        self.config = AutoConfig.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.context_len = int(getattr(self.config, "max_position_embeddings", 1 << 20))
        self.vocab_size = int(self.config.vocab_size)
        layers = layers_to_capture or default_layers_to_capture(self.num_layers)
        if len(layers) != AUX_LAYERS or not all(0 < i < self.num_layers for i in layers):
            raise ValueError(
                f"layers_to_capture must be {AUX_LAYERS} ids in 1..{self.num_layers - 1}, "
                f"got {list(layers)}"
            )
        self.layers_to_capture = tuple(layers)
        self.config_sha256 = hashlib.sha256((model_path / "config.json").read_bytes()).hexdigest()

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    @torch.inference_mode()
    def forward_chunk(self, cache: Any, input_ids: list[int], prefix_len: int) -> ChunkOutput:
        """Run one chunk of one request on top of its cache (which holds ``prefix_len`` tokens)."""
        ids = torch.tensor([input_ids], dtype=torch.long)
        positions = torch.arange(prefix_len, prefix_len + len(input_ids)).unsqueeze(0)
        out = self.model.model(
            input_ids=ids,
            cache=cache,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=True,
        )
        hs = out.hidden_states
        aux = torch.cat([hs[i][0] for i in self.layers_to_capture], dim=-1)
        final = out.last_hidden_state[0]
        logits = self.model.lm_head(final[-1:])
        return ChunkOutput(hidden=final, aux=aux, next_token=int(logits.argmax(-1)),
                           logits=logits[0].float())

    @torch.inference_mode()
    def token_logprobs(self, hidden: torch.Tensor, next_ids: list[int]) -> list[float]:
        """``log_softmax(lm_head(hidden[i]))[next_ids[i]]`` per row, as SGLang's logits
        processor computes prompt logprobs: logits in the model's dtype, widened to float32."""
        rows = hidden[: len(next_ids)]
        logits = self.model.lm_head(rows).float()
        lp = torch.log_softmax(logits, dim=-1)
        return lp[torch.arange(len(next_ids)), torch.tensor(next_ids, dtype=torch.long)].tolist()
