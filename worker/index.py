"""The Redis index of one run: what is done, failed, rejected, running; attempt counters.

An index, not the truth: the output disk decides what is done. Losing it loses no work.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import redis

from worker import keys
from worker.errors import Transient

T = TypeVar("T")


def _redis_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Translate ``redis.RedisError`` into ``Transient`` (the farm's one boundary for Redis)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as e:
            raise Transient(f"redis: {type(e).__name__}: {e}") from e
    return wrapper


@dataclass(frozen=True)
class Counts:
    done: int
    failed: int
    rejected: int
    running: int
    bytes: int
    tokens: int
    total: int
    done_last_window: int
    window_s: float


class RunIndex:
    """All Redis bookkeeping for one fingerprint id.

    Every public method translates ``redis.RedisError`` into ``Transient``: an unreachable
    Redis is a condition to wait out, never a reason to lose a sample.
    """

    def __init__(self, r: redis.Redis, fingerprint_id: str) -> None:
        self.r = r
        self.fp = fingerprint_id

    def k(self, name: str) -> str:
        return keys.run_key(self.fp, name)

    @_redis_errors
    def next_attempt(self, key: str) -> int:
        """Count one more started attempt (retries and redeliveries alike)."""
        return int(self.r.hincrby(self.k(keys.ATTEMPTS), key, 1))

    @_redis_errors
    def refund_attempt(self, key: str) -> None:
        """An attempt that never reached the server (it was down) does not count."""
        self.r.hincrby(self.k(keys.ATTEMPTS), key, -1)

    @_redis_errors
    def mark_running(self, key: str, worker: str, attempt: int) -> None:
        body = orjson.dumps({"worker": worker, "attempt": attempt, "since": time.time()})
        self.r.hset(self.k(keys.RUNNING), key, body)

    @_redis_errors
    def clear_running(self, key: str) -> None:
        self.r.hdel(self.k(keys.RUNNING), key)

    @_redis_errors
    def mark_done(self, key: str, size_bytes: int, tokens: int) -> None:
        p = self.r.pipeline()
        p.zadd(self.k(keys.DONE), {key: time.time()})
        p.hset(self.k(keys.BYTES), key, size_bytes)
        p.hset(self.k(keys.TOKENS), key, tokens)
        p.hdel(self.k(keys.RUNNING), key)
        p.hdel(self.k(keys.FAILED), key)
        p.execute()

    @_redis_errors
    def mark_failed(self, key: str, reason: str, attempts: int) -> None:
        body = orjson.dumps({"reason": reason, "attempts": attempts, "at": time.time()})
        p = self.r.pipeline()
        p.hset(self.k(keys.FAILED), key, body)
        p.hdel(self.k(keys.RUNNING), key)
        p.execute()

    @_redis_errors
    def mark_rejected(self, key: str, reason: str, record: str = "", sha: str = "") -> None:
        """``sha``: the content rejected; enqueue skips the same content next time."""
        body = orjson.dumps({"reason": reason, "record": record, "sha": sha, "at": time.time()})
        p = self.r.pipeline()
        p.hset(self.k(keys.REJECTED), key, body)
        p.hdel(self.k(keys.RUNNING), key)
        p.execute()

    @_redis_errors
    def forget_outcome(self, key: str) -> None:
        """Before a deliberate requeue: clear failed/rejected marks and the attempt counter."""
        p = self.r.pipeline()
        for name in (keys.FAILED, keys.REJECTED, keys.ATTEMPTS):
            p.hdel(self.k(name), key)
        p.execute()

    @_redis_errors
    def set_meta(self, **fields: Any) -> None:
        self.r.hset(self.k(keys.META), mapping={k: str(v) for k, v in fields.items()})

    @_redis_errors
    def add_data_file(self, path: str) -> None:
        self.r.sadd(self.k(keys.DATA_FILES), path)

    @_redis_errors
    def data_files(self) -> list[str]:
        return sorted(x.decode() for x in self.r.smembers(self.k(keys.DATA_FILES)))  # type: ignore[union-attr]

    @_redis_errors
    def meta(self) -> dict[str, str]:
        raw: dict[bytes, bytes] = self.r.hgetall(self.k(keys.META))  # type: ignore[assignment]
        return {k.decode(): v.decode() for k, v in raw.items()}

    @_redis_errors
    def outcomes(self, name: str) -> dict[str, dict[str, Any]]:
        """``failed`` or ``rejected`` entries: key -> {reason, ...}."""
        raw: dict[bytes, bytes] = self.r.hgetall(self.k(name))  # type: ignore[assignment]
        return {k.decode(): orjson.loads(v) for k, v in raw.items()}

    @_redis_errors
    def counts(self, window_s: float = 300.0) -> Counts:
        now = time.time()
        p = self.r.pipeline()
        p.zcard(self.k(keys.DONE))
        p.hlen(self.k(keys.FAILED))
        p.hlen(self.k(keys.REJECTED))
        p.hlen(self.k(keys.RUNNING))
        p.hvals(self.k(keys.BYTES))
        p.hvals(self.k(keys.TOKENS))
        p.hget(self.k(keys.META), "total")
        p.zcount(self.k(keys.DONE), now - window_s, now)
        done, failed, rejected, running, sizes, tokens, total, recent = p.execute()
        return Counts(done=done, failed=failed, rejected=rejected, running=running,
                      bytes=sum(int(x) for x in sizes), tokens=sum(int(x) for x in tokens),
                      total=int(total or 0), done_last_window=recent, window_s=window_s)

