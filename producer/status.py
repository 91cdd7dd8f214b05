"""``status``: where a run stands, from the Redis index and the broker."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field

import redis

from producer.queue_scan import broker_depth
from sglang_patch import contracts as c
from worker import keys
from worker.admission import Admission, Limits, host_limits
from worker.client import ServerClient
from worker.index import RunIndex
from worker.settings import Settings


@dataclass(frozen=True)
class Status:
    total: int
    done: int
    queued: int
    unacked: int
    running: int
    failed: int
    rejected: int
    bytes: int
    tokens: int
    rate_per_s: float
    eta_s: float | None
    # this host's admission: limits, and what is held now (when the dump dir is local)
    admission: dict[str, object] = field(default_factory=dict)

    @property
    def remaining(self) -> int:
        return max(self.total - self.done - self.failed - self.rejected, 0)

    @property
    def finished(self) -> bool:
        """Every sample has an outcome and nothing is in flight."""
        return self.remaining == 0 and self.queued == 0 and self.unacked == 0

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "remaining": self.remaining, "finished": self.finished}

    def line(self) -> str:
        eta = "-" if self.eta_s is None else f"{self.eta_s:.0f}s"
        return (f"total {self.total}  done {self.done}  queued {self.queued}  "
                f"running {self.running}  failed {self.failed}  rejected {self.rejected}  "
                f"{self.bytes / 1e6:.1f} MB  {self.rate_per_s:.2f} samples/s  ETA {eta}"
                + _admission_text(self.admission))


def read_status(settings: Settings, fingerprint: c.Fingerprint, window_s: float = 120.0) -> Status:
    r = redis.Redis.from_url(settings.redis_url)
    counts = RunIndex(r, fingerprint.id).counts(window_s)
    waiting, unacked = broker_depth(r, settings.queue)
    rate = counts.done_last_window / window_s
    remaining = max(counts.total - counts.done - counts.failed - counts.rejected, 0)
    return Status(total=counts.total, done=counts.done, queued=waiting, unacked=unacked,
                  running=counts.running, failed=counts.failed, rejected=counts.rejected,
                  bytes=counts.bytes, tokens=counts.tokens, rate_per_s=rate,
                  eta_s=(remaining / rate) if rate > 0 else None,
                  admission=host_admission(settings, fingerprint))


def host_admission(settings: Settings, fingerprint: c.Fingerprint) -> dict[str, object]:
    """This host's in-flight limit and dump budget (as its workers compute them), and what
    its workers hold now when the dump dir is on this host."""
    async def limits_now() -> Limits:
        client = ServerClient(settings.server_url, timeout_s=1.0)
        try:
            return await host_limits(settings, fingerprint.hidden_size, client)
        finally:
            await client.close()

    limits = asyncio.run(limits_now())
    out: dict[str, object] = {"max_in_flight": limits.max_in_flight,
                              "dump_budget_bytes": limits.dump_budget_bytes,
                              "limits_from": limits.source}
    if settings.dump_dir.is_dir():
        held = Admission(settings.dump_dir, limits, wait_s=0).usage()
        out.update(in_flight=held.requests, dump_bytes_held=held.dump_bytes)
    return out


def _admission_text(a: dict[str, object]) -> str:
    if not a:
        return ""
    held = f"{a['in_flight']}/" if "in_flight" in a else "max "
    gb = f"{int(str(a['dump_bytes_held'])) / 1e9:.2f}/" if "dump_bytes_held" in a else ""
    budget_gb = int(str(a["dump_budget_bytes"])) / 1e9
    return f"  in flight {held}{a['max_in_flight']}  dumps {gb}{budget_gb:.2f} GB"


def failures(settings: Settings, fingerprint: c.Fingerprint) -> list[str]:
    """One line per failed or rejected sample: key, kind, reason."""
    index = RunIndex(redis.Redis.from_url(settings.redis_url), fingerprint.id)
    out = []
    for kind in (keys.FAILED, keys.REJECTED):
        for key, body in sorted(index.outcomes(kind).items()):
            out.append(f"{kind:8} {key}: {body.get('reason')}")
    return out
