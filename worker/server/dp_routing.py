"""Which attention-DP group of the server a request goes to (``FARM_DP_ROUTING``).

DP groups step together, so a step lasts as long as its busiest group's (SGLang 0.5.23,
``prepare_mlp_sync_batch_raw``), and SGLang's round robin is blind to request length. The host
knows its requests in flight and its dumps held (``admission``), so it can pin each request:
``least-tokens`` (fewest waiting tokens, then bytes held), ``least-bytes`` (the reverse), or
``server`` (SGLang's own). Measured in docs/benchmarks.md; test: tests/unit/test_dp_routing.py::
test_the_rules_pick_the_group_with_the_least_waiting_tokens_or_held_bytes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from worker.core.settings import DP_ROUTING_RULES

RULES = DP_ROUTING_RULES  # the setting's values, named in settings.py
SERVER, LEAST_TOKENS, LEAST_BYTES = RULES
NO_GROUP = -1  # a request not pinned to a group


class Held(Protocol):
    """What one admission slot holds (``admission.Holding``)."""

    @property
    def requests(self) -> int: ...
    @property
    def dump_bytes(self) -> int: ...
    @property
    def group(self) -> int: ...


def choose_group(rule: str, groups: int, held: Iterable[Held]) -> int:
    """The group for the next request under ``rule``, given what the host's slots hold;
    ``NO_GROUP`` for ``server`` or a server without groups."""
    if rule == SERVER or groups <= 1:
        return NO_GROUP
    waiting, holding = [0] * groups, [0] * groups  # dump bytes stand for tokens here
    for h in held:
        if 0 <= h.group < groups:
            holding[h.group] += h.dump_bytes
            if h.requests:
                waiting[h.group] += h.dump_bytes
    if rule == LEAST_TOKENS:
        return min(range(groups), key=lambda g: (waiting[g], holding[g], g))
    if rule == LEAST_BYTES:
        return min(range(groups), key=lambda g: (holding[g], waiting[g], g))
    raise ValueError(f"unknown DP routing rule {rule!r} (one of {', '.join(RULES)})")
