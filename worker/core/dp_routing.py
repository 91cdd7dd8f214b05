"""Which attention-DP group of the server a request goes to (``FARM_DP_ROUTING``).

Under DP attention each group has its own scheduler and queue, and all groups step together:
a step lasts as long as its busiest group (SGLang 0.5.23, ``prepare_mlp_sync_batch_raw``), so
uneven queues waste the others' share. Without ``routed_dp_rank`` SGLang deals requests round
robin, blind to their length. The host knows every request it has at the server and every
dump it holds (``admission``'s slots), so it can pin each request to a group itself:

- ``server``: no pin; SGLang's own dispatch (round robin by default);
- ``least-tokens``: the group with the fewest tokens of this host's requests still awaiting
  their answer (its queue), ties by the fewest dump bytes held, then the lowest group;
- ``least-bytes``: the group with the fewest dump bytes held (answered or not, until the
  worker has stored and deleted them), ties by the fewest tokens waiting, then the lowest.

Measured on the synthetic server (``bench/dp_routing.py``, ``docs/benchmarks.md``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

SERVER, LEAST_TOKENS, LEAST_BYTES = "server", "least-tokens", "least-bytes"
RULES = (SERVER, LEAST_TOKENS, LEAST_BYTES)
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
