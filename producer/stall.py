"""When a run is stalled: its work waits and nothing moves; why, and the fix.

The rule (``judge``), for a run that is not finished and has work a worker could take (samples
without an outcome that are not parked, or task messages in the broker) is below."""

# - **no worker**: no host of the run has a fresh heartbeat (``FARM_HEARTBEAT_TTL_S``) and no
#   process says it is paused (a worker waiting at its start for the canary says so before its
#   host beats). Nothing can move, so this needs no waiting period: it shows within one TTL of
#   the last worker's death.
# - **nothing finished for longer than the slowest sample may take**: no sample got an outcome
#   (done, failed or rejected) for longer than ``stall_after_s``: the time limit of a sample of
#   ``FARM_MAX_TOKENS`` tokens plus the longest retry backoff. Every attempt ends within its
#   delivery's time limit, so a working farm finishes some sample within that time; a slow
#   sample under its limit is not a stall. The clock starts again at each publication (an
#   ``enqueue``, a requeue, the reconciler) and at each worker's start, so a run given new work
#   after a quiet spell, or whose workers were restarted, is not called stalled for the past.
#   The reason names what the workers wait on (the server, the dump dir, another fault they
#   paused for) or, when none waits, that nothing finishes.
#
# A process paused for a fault under that time is "paused", not stalled: a server restart or a
# disk freed clears it. The dashboard adds one reason of its own: Redis does not answer.
# Test: tests/farm/test_stall.py.

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from engine_dump.dumpfile import bytes_per_token
from engine_dump.fingerprint import Fingerprint
from worker.core import time_limits
from worker.core.errors import SERVER_SILENT
from worker.core.settings import Settings

NO_WORKER = "no_worker"
SERVER_DOWN = "server_down"
DUMP_DIR = "dump_dir"
PAUSED = "paused"  # every worker waits out another fault (disk, output dir, canary)
NO_PROGRESS = "no_progress"
REDIS = "redis"

FIXES = {
    NO_WORKER: "start the workers (systemctl start hsfarm-worker@{1..4}); one that stopped "
               "says why in its log (journalctl -u 'hsfarm-worker@*'), and one waiting at its "
               "start for Redis or the server says so there too",
    SERVER_DOWN: "restart the inference server (systemctl restart hsfarm-sglang, or "
                 "hsfarm-vllm; its log: journalctl -u hsfarm-sglang); the workers resume by "
                 "themselves",
    DUMP_DIR: "do what the reason says for the dump dir (df -h $FARM_DUMP_DIR; make it again "
              "as the server's user, or free its tmpfs); the workers resume by themselves",
    PAUSED: "fix what the reason names (ops/RUNBOOK.md has each case); the workers resume by "
            "themselves",
    NO_PROGRESS: "read the workers' and the server's logs (journalctl -u 'hsfarm-worker@*' -u "
                 "hsfarm-sglang); 'python -m producer status --failures' lists the errors of "
                 "retrying samples",
    REDIS: "start Redis (systemctl start hsfarm-redis) or correct REDIS_URL; the workers wait "
           "for it and resume by themselves",
}
_WAITS_ON = {SERVER_DOWN: "the inference server does not answer",
             DUMP_DIR: "the dump dir cannot take dumps",
             PAUSED: "the workers wait out a fault"}
# a wait on the server (worker/waits.py, the canary's check); a canary check it failed midway
_SERVER_PAUSE = re.compile(SERVER_SILENT + r"|\bServerUnavailable\b")
_DUMP_DIR_PAUSE = re.compile(r"^dump dir ")  # worker/core/dumps.py, worker/waits.py


@dataclass(frozen=True)
class Stall:
    """Why a run is stalled (``kind``, one of the constants above), in words, and the fix."""

    kind: str
    reason: str
    fix: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Signals:
    """What the rule reads, gathered by ``status`` from the index, the broker and the hosts."""

    work_waits: bool  # not finished, and a worker has something to take
    hosts: list[dict[str, Any]]  # hosts.per_host(): alive, server, heartbeat_age_s...
    paused: dict[str, dict[str, Any]]  # process -> {reason, at}: fresh pause entries
    last_moved_at: float | None  # newest outcome, publication or worker start
    now: float
    stall_after_s: float
    heartbeat_ttl_s: float
    running: int = 0
    retrying: int = 0
    retry_reasons: list[str] = field(default_factory=list)


def stall_after_s(settings: Settings, fingerprint: Fingerprint) -> float:
    """How long a working farm may go without an outcome: the time limit of the run's
    longest sample (``FARM_MAX_TOKENS``) plus the longest retry backoff."""
    per_token = bytes_per_token(fingerprint.dtype, fingerprint.hidden_size)
    longest = time_limits.for_tokens(settings, fingerprint.max_tokens, per_token)
    return longest.hard_s + settings.retry_backoff_max_s


def pause_kind(reason: str) -> str:
    """The kind of fault a paused process waits on, from its reason."""
    if _SERVER_PAUSE.search(reason):
        return SERVER_DOWN
    if _DUMP_DIR_PAUSE.match(reason):
        return DUMP_DIR
    return PAUSED


def judge(s: Signals) -> Stall | None:
    """The run's stall, or None while it moves (or has nothing to do)."""
    if not s.work_waits:
        return None
    if not any(h.get("alive") for h in s.hosts) and not s.paused:
        return _no_worker(s)
    quiet_s = s.now - s.last_moved_at if s.last_moved_at is not None else None
    if quiet_s is None or quiet_s <= s.stall_after_s:
        return None
    return _why_nothing_finishes(s, quiet_s)


def _no_worker(s: Signals) -> Stall:
    ages = [h["heartbeat_age_s"] for h in s.hosts if h.get("heartbeat_age_s") is not None]
    seen = (f"the last heartbeat was {_secs(min(ages))} ago" if ages
            else "no worker has started for this run")
    return Stall(NO_WORKER, f"no worker of this run is alive ({seen}; a worker is dead once "
                            f"its heartbeat is {_secs(s.heartbeat_ttl_s)} old)",
                 FIXES[NO_WORKER])


def _why_nothing_finishes(s: Signals, quiet_s: float) -> Stall:
    quiet = (f"no sample finished in {_secs(quiet_s)}, longer than the slowest sample's time "
             f"limit ({_secs(s.stall_after_s)})")
    reasons = [str(b.get("reason", "")) for b in s.paused.values()]
    waiting = {kind: [r for r in reasons if pause_kind(r) == kind]
               for kind in (SERVER_DOWN, DUMP_DIR, PAUSED)}
    alive = [h for h in s.hosts if h.get("alive")]
    down = [h for h in alive if h.get("server") != "ok"]
    # the server first: one that is down also fails the canary and leaves no dump dir
    if not waiting[SERVER_DOWN] and alive and len(down) == len(alive):
        return Stall(SERVER_DOWN, f"{quiet}: {_WAITS_ON[SERVER_DOWN]} (host "
                                  f"{down[0]['host']}: {down[0].get('server')})",
                     FIXES[SERVER_DOWN])
    for kind, why in waiting.items():
        if why:
            return Stall(kind, f"{quiet}: {_WAITS_ON[kind]} ({len(why)} process(es) paused: "
                               f"{why[0]})", FIXES[kind])
    doing = f"running {s.running}, retrying {s.retrying}"
    if s.retry_reasons:
        doing += f"; last error: {s.retry_reasons[0][:200]}"
    return Stall(NO_PROGRESS, f"{quiet} ({doing})", FIXES[NO_PROGRESS])


def redis_stall(where: str, error: str) -> Stall:
    """The stall of a run whose Redis does not answer (what the dashboard sees)."""
    return Stall(REDIS, f"Redis at {where} does not answer ({error}): no worker can take or "
                        "record a sample", FIXES[REDIS])


def run_state(finished: bool, stall: Stall | dict[str, Any] | None, paused: bool) -> str:
    """One word for the run: ``finished``, ``stalled``, ``paused`` or ``running``."""
    if finished:
        return "finished"
    if stall:
        return "stalled"
    return "paused" if paused else "running"


def _secs(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f} min"
