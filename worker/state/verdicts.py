"""The canary's verdict that a host's processes share, and the lock of the one process checking.

Per server start of a host's dump dir (``where``: the host, its machine, the dump dir and the
server's ready markers): ``ok`` holds for ``FARM_CANARY_INTERVAL_S``, so after a restart sixteen
pool processes do not each put the long canary's dump in tmpfs; ``mismatch`` holds a day and
makes every process check before its next sample. Each verdict says when its check began and
its summary. Redis errors become ``Transient`` here. Test: tests/farm/test_canary.py::
test_processes_of_a_host_share_the_verdict.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from worker.core import liveness
from worker.state import keys
from worker.state import lease as leases
from worker.state.broker import redis_errors
from worker.state.index import RunIndex

OK, MISMATCH = b"ok", b"mismatch"
MISMATCH_TTL_S = 86400


@dataclass(frozen=True)
class Verdict:
    """A shared verdict: its kind (``OK``, ``MISMATCH``, or None: none), when its check
    began (wall clock), and its summary."""

    kind: bytes | None = None
    at: float = 0.0
    why: str = ""

    @classmethod
    def parse(cls, raw: bytes | str | None) -> Verdict:
        if not raw:
            return cls()
        if isinstance(raw, str):
            raw = raw.encode()
        kind, _, rest = raw.partition(b":")
        at, _, why = rest.partition(b":")
        try:
            return cls(kind, float(at), why.decode(errors="replace"))
        except ValueError:
            return cls(kind, 0.0, why.decode(errors="replace"))


class Verdicts:
    """The verdict and the lock of one server start (``epoch``) of this host's dump dir."""

    def __init__(self, index: RunIndex, dump_dir: str, epoch: object) -> None:
        where = hashlib.sha256(json.dumps([liveness.HOST, liveness.MACHINE, dump_dir, epoch]
                                          ).encode()).hexdigest()[:16]
        self._r = index.r
        self.key = keys.run_key(index.run_id, f"{keys.CANARY}:{where}")
        self.lock_key = keys.run_key(index.run_id, f"{keys.CANARY_LOCK}:{where}")

    @redis_errors
    def read(self) -> Verdict:
        return Verdict.parse(self._r.get(self.key))

    @redis_errors
    def try_lock(self, ttl_s: float) -> leases.Lease | str:
        """The lock (a lease), or who holds it; a holder gone from this machine is taken over."""
        return leases.try_acquire(self._r, self.lock_key, ttl_s)

    @redis_errors
    def record(self, passed: bool, started: float, summary: str, interval_s: float) -> None:
        """A check's verdict: a pass for ``interval_s``, a mismatch for a day."""
        kind = OK if passed else MISMATCH
        self._r.set(self.key, b":".join([kind, repr(started).encode(), summary.encode()]),
                    ex=max(1, int(interval_s)) if passed else MISMATCH_TTL_S)
