"""Attention-DP groups in the reference server: SGLang 0.5.23's dispatch and lockstep, emulated.

``--attn-dp-size N`` gives the reference server N groups, each its own scheduler, as SGLang
runs ``--tp T --dp N --enable-dp-attention``: a request goes to its ``routed_dp_rank`` or round
robin (``pick``); all groups step together, an idle one running an idle pass, so a step lasts
as long as its busiest group (``_step``); answers carry ``meta_info.dp_rank`` (SGLang's
``tokenizer_manager.py:2616``). ``load``: per group tokens, requests, idle passes, dump bytes.
Test: tests/farm/test_dp_groups.py::test_groups_step_together_and_an_idle_group_runs_idle_passes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine_dump.dumpfile import dump_path
from engine_dump.rids import parse_rid

log = logging.getLogger("hsfarm.reference_server")
HEALTH_RID_PREFIX = "HEALTH_CHECK_"
_UNSEEN_DUMP_TTL_S = 600.0  # a dump that never appeared (an .err, not ours) stops counting


def routed_rank_error(rank: object, groups: int) -> str | None:
    """SGLang's refusal of a ``routed_dp_rank`` (its message), None when it is acceptable.

    As ``managers/tokenizer_manager.py:915-924`` of SGLang 0.5.23: out of range is a 400; 0 on a
    server without groups is ignored."""
    if rank is None:
        return None
    if type(rank) is not int:
        return f"routed_dp_rank must be an integer, got {rank!r}"
    if groups <= 1 and rank == 0:
        return None  # ignored by SGLang without groups
    if rank < 0 or rank >= groups:
        return f"routed_dp_rank={rank} out of range [0, {groups})"
    return None


class Group(Protocol):
    """What ``DPGroups`` needs of a group's scheduler (``reference_server.Scheduler``)."""

    running: set[str]
    tokens_done: int
    forward_passes: int

    def submit(self, req: Any) -> None: ...
    def abort(self, req: Any) -> None: ...
    def next_batch(self) -> Any: ...
    def forward(self, batch: Any) -> int: ...
    def fail(self, batch: Any, error: BaseException) -> None: ...
    def finish_done(self, batch: Any) -> list[Any]: ...


@dataclass
class _GroupLoad:
    requests_done: int = 0
    requests_routed: int = 0  # of them, sent with routed_dp_rank
    idle_passes: int = 0
    dumps: dict[str, tuple[float, bool]] = field(default_factory=dict)  # rid → (t, seen)


class DPGroups:
    """N groups behind one server: dispatch, then forward steps taken by all groups at once, in
    one model thread. N = 1 is a server without groups: its scheduler's passes, paced so that
    a pass of n tokens lasts at least n / ``tokens_per_s`` (a fast stand-in model serves at a
    GPU host's rate); ``busy_s`` counts the time in passes (``1 - busy_s / uptime``: how idle
    the clients left the server)."""

    def __init__(self, groups: list[Group], wake: asyncio.Event, tokens_per_s: float,
                 dump_dir: Path, forward_delay_s: float = 0.0) -> None:
        self.groups = groups
        self.forward_delay_s = forward_delay_s
        self.wake = wake  # shared by the groups: any submit wakes the lockstep loop
        self.tokens_per_s = tokens_per_s
        self.dump_dir = dump_dir
        self.round_robin = 0
        self.health_round_robin = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._load = [_GroupLoad() for _ in groups]
        self.busy_s = 0.0
        self.steps = 0
        self.step_tokens = 0  # tokens over all steps
        self.step_capacity = 0  # N x the busiest group's tokens, over all steps
        self.started_s = time.monotonic()

    @property
    def running(self) -> set[str]:
        return set().union(*(g.running for g in self.groups))

    @property
    def tokens_done(self) -> int:
        return sum(g.tokens_done for g in self.groups)

    @property
    def forward_passes(self) -> int:
        return self.steps

    def pick(self, rid: str, routed_dp_rank: int | None) -> int:
        """The group a request goes to, as SGLang's DataParallelController picks it.

        SGLang 0.5.23 ``managers/data_parallel_controller.py``: a routed request goes to its group
        (:865) and moves no counter; health checks have a round-robin counter of their own
        (:845-863); any other request goes round robin (:880): ``--load-balance-method auto`` is
        ``round_robin`` outside disaggregation (``arg_groups/serving_hook.py:217-236``)."""
        if routed_dp_rank is not None:
            self._load[routed_dp_rank].requests_routed += 1
            return routed_dp_rank
        if rid.startswith(HEALTH_RID_PREFIX):
            group = self.health_round_robin
            self.health_round_robin = (group + 1) % len(self.groups)
            return group
        group = self.round_robin
        self.round_robin = (group + 1) % len(self.groups)
        return group

    def submit(self, req: Any, group: int) -> None:
        """Queue ``req`` in ``group``; a rid running in any group is refused as SGLang does."""
        holder = next((g for g in self.groups if req.rid in g.running), self.groups[group])
        holder.submit(req)  # the group running it already raises the duplicate-rid refusal

    def abort(self, req: Any) -> None:
        req.aborted = True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wake.wait()
            batches = [g.next_batch() for g in self.groups]
            if not any(b.items for b in batches):
                self.wake.clear()
                continue
            t0 = time.monotonic()
            try:
                await loop.run_in_executor(self._executor, self._step, batches)
            except Exception as e:  # a broken step fails its requests, not the server
                log.exception("forward failed")
                for g, b in zip(self.groups, batches, strict=True):
                    g.fail(b, e)
                continue
            finally:
                self.busy_s += time.monotonic() - t0
            now = time.monotonic()
            for g, b, load in zip(self.groups, batches, self._load, strict=True):
                for req in g.finish_done(b):
                    load.requests_done += 1
                    if parse_rid(req.rid) is not None:
                        load.dumps[req.rid] = (now, False)

    def _step(self, batches: list[Any]) -> None:
        """One step of every group (idle ones included), paced to its busiest group.

        As SGLang's ``prepare_mlp_sync_batch_raw`` (``managers/scheduler_components/dp_attn.py``):
        a step of per-group token counts t_g lasts N x max(t_g) / ``tokens_per_s``, so balanced
        groups serve the full rate and an uneven step wastes the others' share."""
        t0 = time.monotonic()
        tokens = []
        for g, b, load in zip(self.groups, batches, self._load, strict=True):
            if b.items:
                tokens.append(g.forward(b))
            else:
                tokens.append(0)
                load.idle_passes += 1
        self.steps += 1
        self.step_tokens += sum(tokens)
        self.step_capacity += len(self.groups) * max(tokens)
        if self.tokens_per_s > 0:  # the step lasts as long as its busiest group at that rate
            busiest_s = len(self.groups) * max(tokens) / self.tokens_per_s
            time.sleep(max(0.0, t0 + busiest_s - time.monotonic()))
        if self.forward_delay_s:
            time.sleep(self.forward_delay_s)

    def load(self) -> dict[str, Any]:
        """Per group: tokens, requests, idle passes, bytes of its dumps in the dump dir now;
        and the steps' efficiency (tokens / N x the busiest group's tokens, over all steps)."""
        per = []
        for g, load in zip(self.groups, self._load, strict=True):
            per.append({"tokens_done": g.tokens_done, "requests_done": load.requests_done,
                        "requests_routed": load.requests_routed,
                        "idle_passes": load.idle_passes,
                        "dump_bytes_in_dir": self._dump_bytes(load)})
        efficiency = self.step_tokens / self.step_capacity if self.step_capacity else 1.0
        return {"dp_groups": per, "dp_step_efficiency": round(efficiency, 4),
                "dp_step_tokens": self.step_tokens, "dp_step_capacity": self.step_capacity}

    def _dump_bytes(self, load: _GroupLoad) -> int:
        """Bytes of the group's dumps present now; forgets those collected (seen, then gone)."""
        total, now = 0, time.monotonic()
        for rid, (t, seen) in list(load.dumps.items()):
            try:
                total += dump_path(self.dump_dir, rid).stat().st_size
                load.dumps[rid] = (t, True)
            except FileNotFoundError:
                if seen or now - t > _UNSEEN_DUMP_TTL_S:
                    del load.dumps[rid]
        return total
