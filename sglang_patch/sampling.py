"""The reference server's decoding: the ``sampling_params`` a regenerating farm sends
(``Engine.decode``) checked as SGLang's ``/generate`` checks them, and the next token drawn from
a request's logits: temperature (default 1.0; under 1e-5 greedy), top-p, top-k, stop tokens,
``ignore_eos``, and ``sampling_seed``, which it always honours (SGLang only under
``--enable-deterministic-inference``). Test: tests/farm/test_reference_server.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

GREEDY_BELOW = 1e-5  # SGLang: a temperature under this is greedy (sampling_params.py)


class SamplingError(ValueError):
    """A ``sampling_params`` SGLang would refuse with a 400 (the message is the answer's)."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def generator(self) -> torch.Generator:
        """The request's own random stream: its seed's, else a fresh one."""
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None
                      else int.from_bytes(os.urandom(8), "little") >> 1)
        return g


def parse(sp: Any) -> Sampling:
    """``sampling_params`` as SGLang's ``SamplingParams.verify`` checks them.

    ``max_new_tokens`` absent is 0 here (SGLang's default is 128): the farm always says it,
    and the server's other callers (health checks) ask for their own.

    Raises:
        SamplingError: a value SGLang refuses.
    """
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise SamplingError("sampling_params must be an object")
    mnt = sp.get("max_new_tokens", 0)
    if type(mnt) is not int or mnt < 0:
        raise SamplingError(f"max_new_tokens must be at least 0, got {mnt}.")
    temperature = _number(sp, "temperature", 1.0)
    if temperature < 0:
        raise SamplingError(f"temperature must be non-negative, got {temperature}.")
    top_p = _number(sp, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise SamplingError(f"top_p must be in (0, 1], got {top_p}.")
    top_k = sp.get("top_k", -1)
    if type(top_k) is not int or not (top_k == -1 or top_k >= 1):
        raise SamplingError(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(type(t) is int for t in stops):
        raise SamplingError("stop_token_ids must be a list of integers")
    seed = sp.get("sampling_seed")
    if seed is not None and type(seed) is not int:
        raise SamplingError(f"sampling_seed must be an integer, got {seed!r}.")
    return Sampling(mnt, temperature, top_p, top_k, frozenset(stops),
                    bool(sp.get("ignore_eos", False)), seed)


def _number(sp: dict[str, Any], name: str, default: float) -> float:
    value = sp.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingError(f"{name} must be a number, got {value!r}.")
    return float(value)


def next_token(logits: torch.Tensor, s: Sampling, generator: torch.Generator) -> int:
    """The next token from one position's logits ``[V]``: greedy, or drawn after temperature,
    top-k and top-p (SGLang's order), from ``generator``."""
    if s.greedy:
        return int(logits.argmax(-1))
    scaled = logits.float() / s.temperature
    if s.top_k > 0:
        kth = torch.topk(scaled, min(s.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, 0) - sorted_p > s.top_p  # keep the smallest set >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
