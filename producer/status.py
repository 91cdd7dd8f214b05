"""``status``: where a run stands, from the Redis index and the broker."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

from producer.queue_scan import broker_depth
from sglang_patch import contracts as c
from worker import broker, keys
from worker.admission import Admission, limits_for_host
from worker.index import RunIndex
from worker.settings import Settings


@dataclass(frozen=True)
class Status:
    total: int
    done: int
    queued: int
    unacked: int
    running: int
    retrying: int
    failed: int
    rejected: int
    stale: int
    bytes: int
    tokens: int
    rate_per_s: float
    eta_s: float | None
    # this host's admission: limits, and what is held now (when the dump dir is local)
    admission: dict[str, object] = field(default_factory=dict)

    @property
    def remaining(self) -> int:
        """Samples without an outcome (stale ones have none: their record changed)."""
        return max(self.total - self.done - self.failed - self.rejected, 0)

    @property
    def finished(self) -> bool:
        """Every sample has an outcome and nothing is in flight."""
        return self.remaining == 0 and self.queued == 0 and self.unacked == 0

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "remaining": self.remaining, "finished": self.finished}

    def line(self) -> str:
        eta = "-" if self.eta_s is None else f"{self.eta_s:.0f}s"
        extra = f"  stale {self.stale}" if self.stale else ""
        return (f"total {self.total}  done {self.done}  queued {self.queued}  "
                f"unacked {self.unacked}  running {self.running}  retrying {self.retrying}  "
                f"failed {self.failed}  rejected {self.rejected}{extra}  "
                f"{self.bytes / 1e6:.1f} MB  {self.rate_per_s:.2f} samples/s  ETA {eta}"
                + _admission_text(self.admission))


def read_status(settings: Settings, fingerprint: c.Fingerprint, window_s: float = 300.0) -> Status:
    r = broker.client(settings)
    index = RunIndex(r, fingerprint.id)
    counts = index.counts()
    waiting, unacked = broker_depth(r, settings.queue)
    rate = _rate(r, index, window_s)
    remaining = max(counts.total - counts.done - counts.failed - counts.rejected, 0)
    return Status(total=counts.total, done=counts.done, queued=waiting, unacked=unacked,
                  running=counts.running, retrying=counts.retrying, failed=counts.failed,
                  rejected=counts.rejected, stale=counts.stale, bytes=counts.bytes,
                  tokens=counts.tokens, rate_per_s=rate,
                  eta_s=(remaining / rate) if rate > 0 else None,
                  admission=host_admission(settings, fingerprint))


def host_admission(settings: Settings, fingerprint: c.Fingerprint) -> dict[str, object]:
    """This host's in-flight limit and dump budget (as its workers compute them), and what
    its workers hold now when the dump dir is on this host."""
    limits = limits_for_host(settings, fingerprint.hidden_size, timeout_s=1.0)
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


def _rate(r: redis.Redis, index: RunIndex, window_s: float) -> float:
    """Samples/s over the last ``window_s``, or since the first completion when more recent."""
    now = time.time()
    first = r.zrange(index.k(keys.DONE), 0, 0, withscores=True)
    if not first:
        return 0.0
    since = max(float(first[0][1]), now - window_s)
    n = int(r.zcount(index.k(keys.DONE), since, now))
    return n / max(now - since, 1.0)


def missing_done_files(settings: Settings, fingerprint: c.Fingerprint) -> list[str]:
    """Samples the index calls done whose final file is not on disk (deleted since)."""
    index = RunIndex(broker.client(settings), fingerprint.id)
    out = Path(settings.output_dir)
    return sorted(k for k in index.done_keys() if not c.final_path(out, k).exists())


def failures(settings: Settings, fingerprint: c.Fingerprint) -> list[str]:
    """One line per failed, rejected or stale sample: key, kind, reason."""
    index = RunIndex(broker.client(settings), fingerprint.id)
    out = []
    for kind in (keys.FAILED, keys.REJECTED, keys.STALE, keys.RETRYING):
        for key, body in sorted(index.outcomes(kind).items()):
            out.append(f"{kind:8} {key}: {body.get('reason')}")
    return out
