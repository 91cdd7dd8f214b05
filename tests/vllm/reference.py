"""The transformers float32 forward the dumps are compared with, and how far apart they are."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


@cache
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def reference(model_dir: Path, ids: list[int], aux_ids: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(post-norm final state [n, H], its pre-norm input [n, H], the input of decoder layer k
    [n, H] for each aux id k), read with hooks on the decoder layers and the final norm."""
    model = hf_model(model_dir)
    layers = model.model.layers
    inputs: dict[int, torch.Tensor] = {}
    out: list[torch.Tensor] = []
    hooks = [layers[k].register_forward_pre_hook(
        lambda _m, args, kw, k=k: inputs.__setitem__(k, (args[0] if args else
                                                         kw["hidden_states"])[0].clone()),
        with_kwargs=True) for k in aux_ids]
    hooks.append(model.model.norm.register_forward_hook(
        lambda _m, a, o: out.extend((o[0].clone(), a[0][0].clone()))))
    try:
        model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return out[0], out[1], [inputs[k] for k in aux_ids]


def rel_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per-token relative L2 error ‖got − want‖ / ‖want‖, float32."""
    got, want = got.float(), want.float()
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps each stored value is from the float32 reference rounded to bf16
    (0 where the capture equals transformers up to the storage's own rounding)."""
    a = got.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    b = want.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return (a - b).abs()
