"""A per-sample lease in Redis: two attempts of one sample never run at once.

Duplicate deliveries happen without a crash (a restored message, two producers, the reaper)
and an attempt deletes dumps and writes the final file, so each takes the sample's lease
(``SET NX``, a TTL renewed by a thread), taken over only from a holder that is gone. A holder
cut off from Redis cannot learn it lost the lease: it trusts it up to its TTL less
``TRUST_MARGIN`` after its last renewal sent, then ``check`` raises ``LeaseLost``.
Test: tests/farm/test_idempotency.py::test_duplicate_deliveries_never_run_at_once."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from worker.core import liveness
from worker.core.errors import LeaseLost
from worker.state import keys

log = logging.getLogger("hsfarm.lease")

# Compare-and-set on the holder's token: renew or release only what is still ours.
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then " \
         "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then " \
           "return redis.call('DEL', KEYS[1]) else return 0 end"
# The part of the TTL not trusted: a check this close to the lease's expiry in Redis fails.
# It covers the step from ``check`` to the write it guards and the clocks' rates; renewals
# run every third of the TTL, so a lease that Redis renews is never refused.
TRUST_MARGIN = 0.25
_TAKE_OVER = "if redis.call('GET', KEYS[1]) == ARGV[1] then " \
             "return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) else return nil end"


class Lease:
    """One held lease; ``check`` before anything destructive, ``release`` when done."""

    def __init__(self, r: redis.Redis, name: str, token: str, ttl_s: float,
                 taken_at: float) -> None:
        """``taken_at``: when the command that took the lease was sent (monotonic)."""
        self.r, self.name, self.token, self.ttl_s = r, name, token, ttl_s
        self.renewed_at = taken_at  # when the last successful renewal was sent (monotonic)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="hsfarm-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            sent_at = time.monotonic()
            try:
                if not self.r.eval(_RENEW, 1, self.name, self.token, int(self.ttl_s * 1000)):
                    self.lost.set()
                    return
                self.renewed_at = sent_at
            except redis.RedisError as e:  # renewal resumes when Redis answers again
                log.warning("cannot renew lease %s: %s", self.name, e)

    def trusted_for_s(self) -> float:
        """Seconds the lease is still this holder's for sure (negative: no longer)."""
        return self.renewed_at + self.ttl_s * (1 - TRUST_MARGIN) - time.monotonic()

    def check(self) -> None:
        """Raises LeaseLost when the lease is no longer this attempt's, or may not be: it
        was not renewed for its TTL less the margin (Redis away, or this process stalled)."""
        if self.lost.is_set():
            raise LeaseLost(f"lease {self.name} was lost (this attempt stalled past "
                            f"{self.ttl_s:.0f}s); another attempt owns the sample now")
        if self.trusted_for_s() < 0:
            unrenewed_s = time.monotonic() - self.renewed_at
            raise LeaseLost(f"lease {self.name} not renewed for {unrenewed_s:.1f}s (Redis "
                            f"unreachable?) of its {self.ttl_s:.0f}s TTL: another host may "
                            "hold the sample now, so this attempt writes nothing")

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.r.eval(_RELEASE, 1, self.name, self.token)
        except redis.RedisError as e:  # it expires on its own within the TTL
            log.warning("cannot release lease %s: %s", self.name, e)


def lease_name(fingerprint_id: str, sample_key: str) -> str:
    """The Redis key of a sample's lease."""
    return keys.run_key(fingerprint_id, f"{keys.LEASE}:{sample_key}")


def holder(r: redis.Redis, name: str) -> str | None:
    """Who holds the lease ``name`` (``identity#token``), or None."""
    raw = r.get(name)
    return None if raw is None else (raw.decode() if isinstance(raw, bytes) else str(raw))


def try_acquire(r: redis.Redis, name: str, ttl_s: float) -> Lease | str:
    """The lease, or who holds it now. A holder gone from this machine is taken over."""
    token = f"{liveness.identity()}#{uuid.uuid4().hex[:12]}"
    ttl_ms = int(ttl_s * 1000)
    sent_at = time.monotonic()
    if r.set(name, token, nx=True, px=ttl_ms):
        return Lease(r, name, token, ttl_s, sent_at)
    current = holder(r, name)
    if current is None:
        return "nobody (expired just now)"
    sent_at = time.monotonic()
    if liveness.gone_here(current.split("#", 1)[0]) and r.eval(
            _TAKE_OVER, 1, name, current, token, ttl_ms):
        log.info("took over %s from %s, which is gone", name, current)
        return Lease(r, name, token, ttl_s, sent_at)
    return current


@contextmanager
def held(r: redis.Redis, name: str, ttl_s: float, deadline: float,
         poll_s: float = 0.5) -> Iterator[Lease | None]:
    """Hold the lease ``name`` for the block; None when another holder kept it until
    ``deadline`` (monotonic). A task that waits holds its message: nothing is acknowledged."""
    waited_for = None
    while True:
        got = try_acquire(r, name, ttl_s)
        if isinstance(got, Lease):
            break
        if waited_for is None:
            log.warning("waiting for %s, held by %s", name, got)
            waited_for = got
        if time.monotonic() + poll_s > deadline:
            yield None
            return
        time.sleep(poll_s)
    try:
        yield got
    finally:
        got.release()
