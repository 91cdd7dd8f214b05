"""The oracle for live dumps: the same token ids through transformers, at the same layers.

SGLang's capture id i is the input of layer i, transformers' ``hidden_states[i]``; the final
state is post-norm (``last_hidden_state``). The dump is bf16, the reference float32, so the
comparison is per token, relative to the token's largest value: bf16 keeps 8 significant bits
(0.4% rounding), and a wrong layer, a missed or doubled norm or a shifted row is off by 10%+.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine_dump.dumpfile import M_LAYERS, T_AUX, T_HIDDEN, T_INPUT_IDS

BF16_TOLERANCE = 0.02  # worst per-token relative error allowed


@functools.cache
def _model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(model_dir: Path, ids: list[int],
              layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final post-norm [T,H], aux [T,3H]) for ``ids``, from transformers."""
    return _reference(model_dir, tuple(ids), tuple(layers))


# the last answer is kept: check_dump then layer_errors of one dump run one forward (a
# 32k-token one takes 20-40 s here)
@functools.lru_cache(maxsize=1)
@torch.inference_mode()
def _reference(model_dir: Path, ids: tuple[int, ...],
               layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    out = _model(model_dir).model(torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
    return out.last_hidden_state[0], aux


def token_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Each token's ``max |got - want| / max |want|``."""
    scale = want.abs().amax(dim=-1).clamp_min(1e-6)
    return (got.float() - want).abs().amax(dim=-1) / scale


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst token's ``max |got - want| / max |want|``."""
    return float(token_errors(got, want).max())


def check_dump(path: Path, model_dir: Path, ids: list[int],
               layers: list[int] | None = None) -> float:
    """Assert the dump holds ``ids`` and transformers' states for them; returns the error."""
    dump = load_file(str(path))
    with open(path, "rb") as f:  # the metadata, from the file's own header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    recorded = json.loads(header["__metadata__"][M_LAYERS])
    if layers is not None:
        assert recorded == layers, (recorded, layers)
    assert dump[T_INPUT_IDS].tolist() == ids
    hidden, aux = reference(model_dir, ids, recorded)
    assert dump[T_HIDDEN].dtype == torch.bfloat16 and dump[T_HIDDEN].shape == hidden.shape
    assert dump[T_AUX].dtype == torch.bfloat16 and dump[T_AUX].shape == aux.shape
    err = max(relative_error(dump[T_HIDDEN], hidden), relative_error(dump[T_AUX], aux))
    assert err < BF16_TOLERANCE, f"{path.name}: {err:.4f} off transformers"
    return err


def layer_errors(path: Path, model_dir: Path) -> dict[str, tuple[float, float]]:
    """Per captured layer and the final state: (worst, mean) per-token relative error of a
    dump against transformers, for the report."""
    dump = load_file(str(path))
    ids = dump[T_INPUT_IDS].tolist()
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    layers = json.loads(header["__metadata__"][M_LAYERS])
    hidden, aux = reference(model_dir, ids, layers)
    width = hidden.shape[-1]
    out = {}
    for j, layer in enumerate(layers):
        cols = slice(j * width, (j + 1) * width)
        e = token_errors(dump[T_AUX][:, cols], aux[:, cols])
        out[f"layer {layer} input"] = (float(e.max()), float(e.mean()))
    e = token_errors(dump[T_HIDDEN], hidden)
    out["final (post-norm)"] = (float(e.max()), float(e.mean()))
    return out
