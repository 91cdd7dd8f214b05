"""The transformers float32 forward the dumps are compared with, and how far apart they are:
per layer, per token, for a live case (``Errors``), printed in the session's summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS
from tests.vllm.conftest import measured
from tests.vllm.live import AUX_IDS, LAST_ID, LiveVllm, wait_dump

BF16_TOLERANCE = 2.0**-8  # per token: bf16's own rounding (8 significant bits) stays below it


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


def dump_of(server: LiveVllm, rid: str) -> dict[str, torch.Tensor]:
    return load_file(str(wait_dump(server.dumps, rid)))


def load_file_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata())


@dataclass
class Errors:
    """Per-token relative errors of one case, layer by layer, and bf16 steps off."""

    case: str
    aux_ids: list[int] = field(default_factory=lambda: list(AUX_IDS))
    last_id: int = LAST_ID
    errors: list[list[torch.Tensor]] = field(default_factory=list)
    rounded: list[list[torch.Tensor]] = field(default_factory=list)
    equal: int = 0
    values: int = 0
    worst_ulps: int = 0
    tokens: int = 0

    def __post_init__(self) -> None:
        self.errors = [[] for _ in self.layer_names]
        self.rounded = [[] for _ in self.layer_names]

    @property
    def layer_names(self) -> list[str]:
        return ([f"aux id {k}" for k in self.aux_ids]
                + [f"hidden_state (norm of id {self.last_id})"])

    def add(self, dump: dict[str, torch.Tensor], ids: list[int], model: Path) -> None:
        post, pre, inputs = reference(model, ids, self.aux_ids)
        n, h = len(ids), post.shape[1]
        got = [*dump[T_AUX].view(n, len(self.aux_ids), h).unbind(1), dump[T_HIDDEN]]
        for i, (g, want) in enumerate(zip(got, [*inputs, post], strict=True)):
            self.errors[i].append(rel_errors(g, want))
            self.rounded[i].append(rel_errors(g, want.to(torch.bfloat16)))
            ulps = bf16_ulps(g, want)
            self.equal += int((ulps == 0).sum())
            self.values += ulps.numel()
            self.worst_ulps = max(self.worst_ulps, int(ulps.max()))
        assert torch.equal(dump[T_INPUT_IDS], torch.tensor(ids))
        # hidden_state is the post-norm state: far from the pre-norm one vLLM captures
        assert float(rel_errors(dump[T_HIDDEN], pre).min()) > 0.1
        self.tokens += n

    def report(self) -> None:
        for name, errs, rounded in zip(self.layer_names, self.errors, self.rounded, strict=True):
            e, r = torch.cat(errs), torch.cat(rounded)
            measured(f"{self.case:<36} {name:<30} max {float(e.max()):.2e}  "
                     f"mean {float(e.mean()):.2e}  (vs bf16(hf): max {float(r.max()):.1e}  "
                     f"mean {float(r.mean()):.1e})")
        measured(f"{self.case:<36} {self.tokens} tokens: {self.equal / self.values:.5f} of "
                 f"values equal transformers rounded to bf16, the rest within "
                 f"{self.worst_ulps} bf16 step")
        for errs in self.errors:
            assert float(torch.cat(errs).max()) < BF16_TOLERANCE
        # Not a bound on steps: an element near 0 has a tiny bf16 step, and a chunk boundary
        # that moves with the load changes float32 sums by ~1e-7 of the row, which can be
        # two of its steps (seen once, under load); the per-token error is the bound.
        assert self.equal / self.values > 0.98
