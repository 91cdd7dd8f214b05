"""The Redis index of one run: which samples it has, what is done, failed, rejected, running.

An index, not the truth: the output disk decides what is done, and ``enqueue`` rebuilds the
index from the verified files when Redis lost it. What the run holds is its ``samples``
hash: each sample's data file (a fid, whose path, content and former paths are
worker/state/corpus.py's) and record; ``enqueue`` takes out the samples whose records left the
corpus (``removed``). Every text stored here (reasons, records) is bounded: a hostile or
broken record must not fill Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from worker.core.samples import SampleRef
from worker.state import keys
from worker.state import lease as leases
from worker.state.broker import redis_errors
from worker.state.lease import lease_name

# Delete a ``running`` entry only while it is still the one judged stale and its sample's lease
# is free or still held by the holder seen gone: a new attempt takes the lease before it marks
# itself running, so its entry is never removed.
_PRUNE_RUNNING = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[3] then return 0 end
return redis.call('HDEL', KEYS[1], ARGV[1])
"""
# Record an outcome (failed, rejected, stale, retrying) only while the sample is not done: an
# outcome of an attempt reaches Redis late when Redis was away (a command sent before it
# stopped answering runs when it answers again; a host's TCP sends what a partition held back),
# after the sample was marked done by that attempt or another. The file on disk is the truth:
# whoever finds a done sample's file missing or damaged takes it out of ``done`` first
# (``forget_outcome``, ``unmark_done``), so the outcomes of its redo are recorded.
# KEYS: done, the outcome's hash, running, retrying (or '' for none); ARGV: key, body.
_SET_OUTCOME = """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[1])
if KEYS[4] ~= KEYS[2] then redis.call('HDEL', KEYS[4], ARGV[1]) end
return 1
"""
# A ``running`` entry, likewise, only while the sample is not done: one that lands late would
# show a finished sample running until the next prune. KEYS: done, running; ARGV: key, body.
_SET_RUNNING = """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
return redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
"""
# Refund an attempt Celery cancelled when Redis went away (``worker.steps.outage``), only
# while its ``running`` entry is the one remembered: an attempt started after the reconnection
# writes its own entry, so nothing is refunded twice. KEYS: running, attempts; ARGV: key, body.
_REFUND = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[2], ARGV[1], -1)
return 1
"""
# Names whose entry says a sample is done, and where: what taking it out of ``done`` clears.
_DONE_NAMES = (keys.BYTES, keys.TOKENS, keys.HELD)
MAX_TEXT_CHARS = 500  # longest reason or record description kept in Redis
MAX_MALFORMED = 100  # refused task messages remembered (the newest)


def bounded(text: object, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` as a string of at most ``limit`` characters, saying how much was cut."""
    s = str(text)
    return s if len(s) <= limit else f"{s[:limit]}… [{len(s) - limit} more characters]"


def as_text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


@dataclass(frozen=True)
class Registered:
    """Where a registered sample's record lives (what ``samples`` holds for each key)."""

    fid: int
    offset: int
    length: int
    sha256: str
    index: int

    def encode(self) -> str:
        return f"{self.fid}|{self.offset}|{self.length}|{self.sha256}|{self.index}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Registered:
        fid, offset, length, sha, index = as_text(raw).split("|")
        return cls(int(fid), int(offset), int(length), sha, int(index))

    def ref(self, key: str, file: str = "") -> SampleRef:
        """The task reference of sample ``key`` registered here; ``file``: its data file's
        path ("": the worker resolves it from ``fid``, as for a message)."""
        return SampleRef(key=key, file=file, offset=self.offset, length=self.length,
                         sha256=self.sha256, index=self.index, fid=self.fid)


@dataclass(frozen=True)
class Counts:
    total: int
    done: int
    failed: int
    rejected: int
    stale: int
    retrying: int
    running: int
    bytes: int
    tokens: int
    parked: int = 0  # waiting for their data file to be readable
    removed: int = 0  # left the run: their records left the corpus


class RunIndex:
    """All Redis bookkeeping for one run (``run_id``: ``worker.core.run``).

    Every public method translates ``redis.RedisError`` into ``Transient``: an unreachable
    Redis is a condition to wait out, never a reason to lose a sample.
    """

    def __init__(self, r: redis.Redis, run_id: str) -> None:
        self.r = r
        self.run_id = run_id

    def k(self, name: str) -> str:
        return keys.run_key(self.run_id, name)

    # --- attempts and states of one sample ---------------------------------------------------

    @redis_errors
    def next_attempt(self, key: str) -> int:
        """Count one more started attempt (retries and redeliveries alike)."""
        return int(self.r.hincrby(self.k(keys.ATTEMPTS), key, 1))

    @redis_errors
    def next_try(self, key: str) -> int:
        """A fresh number for the next request's rid (refunded attempts are tries too: the
        server may still run the request that timed out, and refuses a duplicate rid)."""
        return int(self.r.hincrby(self.k(keys.TRIES), key, 1))

    @redis_errors
    def count_generated(self, tokens: int, seconds: float, sample_turns: int = 0) -> None:
        """One regenerated turn of ``tokens`` tokens, decoded in ``seconds`` (its request's);
        ``sample_turns``: it was its sample's last, of that many (what the generation's ETA
        learns turns per sample from)."""
        p = self.r.pipeline(transaction=True)
        p.hsetnx(self.k(keys.GENERATED), "first_at", time.time())
        p.hset(self.k(keys.GENERATED), "last_at", time.time())
        p.hincrby(self.k(keys.GENERATED), "turns", 1)
        p.hincrby(self.k(keys.GENERATED), "tokens", tokens)
        p.hincrbyfloat(self.k(keys.GENERATED), "seconds", seconds)
        if sample_turns:
            p.hincrby(self.k(keys.GENERATED), "samples", 1)
            p.hincrby(self.k(keys.GENERATED), "sample_turns", sample_turns)
        p.execute()

    @redis_errors
    def generated(self) -> dict[str, float]:
        """The run's generation in all (``count_generated``): turns, tokens, seconds (its
        requests' summed), first_at and last_at (unix time), samples whose last turn was
        generated and their turns; {} before the first turn."""
        raw = self.r.hgetall(self.k(keys.GENERATED))
        return {k.decode() if isinstance(k, bytes) else str(k): float(v) for k, v in raw.items()}

    @redis_errors
    def refund_attempt(self, key: str) -> None:
        """An attempt that could not run for the environment's sake (server down, disk full)."""
        self.r.hincrby(self.k(keys.ATTEMPTS), key, -1)

    @redis_errors
    def mark_running(self, key: str, worker: str, attempt: int) -> bool:
        """An attempt runs, unless the sample is done (False then: a late entry)."""
        body = orjson.dumps({"worker": worker, "attempt": attempt, "since": time.time()})
        return bool(self.r.eval(_SET_RUNNING, 2, self.k(keys.DONE), self.k(keys.RUNNING), key,
                                body))

    @redis_errors
    def clear_running(self, key: str) -> None:
        self.r.hdel(self.k(keys.RUNNING), key)

    @redis_errors
    def prune_running(self, gone: Callable[[str], bool]) -> int:
        """Drop ``running`` entries whose attempt no longer runs: its sample's lease is free
        (every attempt holds it while running), or its holder is ``gone`` (a process
        identity; a holder on another host stops renewing and its lease expires). Returns how
        many were dropped."""
        raw: dict[bytes, bytes] = self.r.hgetall(self.k(keys.RUNNING))  # type: ignore[assignment]
        dropped = 0
        for k, body in raw.items():
            key = as_text(k)
            lease = lease_name(self.run_id, key)
            holder = self.r.get(lease)
            seen = "" if holder is None else as_text(holder)
            if seen and not gone(seen.split("#", 1)[0]):
                continue
            dropped += int(self.r.eval(_PRUNE_RUNNING, 2, self.k(keys.RUNNING), lease, key,
                                       body, seen))
        return dropped

    @redis_errors
    def prune_paused(self, gone: Callable[[str], bool], max_age_s: float) -> int:
        """Drop ``paused`` entries of processes that are ``gone`` or stopped refreshing them
        ``max_age_s`` ago (a waiting process rewrites its entry at every poll)."""
        now = time.time()
        stale = [k for k, body in self.outcomes(keys.PAUSED).items()
                 if gone(k) or now - float(body.get("at", 0)) > max_age_s]
        return int(self.r.hdel(self.k(keys.PAUSED), *stale)) if stale else 0

    @redis_errors
    def mark_started(self) -> None:
        """Remember when the run's first ``enqueue`` published (kept from then on)."""
        self.r.hsetnx(self.k(keys.META), "started_at", repr(time.time()))

    @redis_errors
    def mark_done(self, key: str, size_bytes: int, tokens: int, host: str = "",
                  sha256: str = "") -> None:
        """Done; ``host``: whose output dir holds its file (``worker.state.hosts``)."""
        p = self.r.pipeline()
        p.zadd(self.k(keys.DONE), {key: time.time()})
        if host:
            p.hset(self.k(keys.HELD), key, f"{host}|{sha256}")
        p.hset(self.k(keys.BYTES), key, size_bytes)
        p.hset(self.k(keys.TOKENS), key, tokens)
        for name in (keys.RUNNING, keys.FAILED, keys.RETRYING, keys.STALE):
            p.hdel(self.k(name), key)
        p.execute()

    @redis_errors
    def mark_done_many(self, done: dict[str, tuple[int, int]],
                       at: dict[str, float] | None = None) -> None:
        """``mark_done`` for many samples (key -> (bytes, tokens)), a batch per round trip;
        ``at``: when each was done (its file's mtime, when relearnt from the disk), so the
        run's history and rate do not see thousands finish in one instant."""
        items, now, at = list(done.items()), time.time(), at or {}
        for i in range(0, len(items), 1000):
            batch = dict(items[i : i + 1000])
            names = list(batch)
            p = self.r.pipeline(transaction=False)
            p.zadd(self.k(keys.DONE), {k: at.get(k, now) for k in names})
            p.hset(self.k(keys.BYTES), mapping={k: v[0] for k, v in batch.items()})
            p.hset(self.k(keys.TOKENS), mapping={k: v[1] for k, v in batch.items()})
            for name in (keys.RUNNING, keys.FAILED, keys.RETRYING, keys.STALE):
                p.hdel(self.k(name), *names)
            p.execute()

    @redis_errors
    def mark_failed(self, key: str, reason: str, attempts: int) -> None:
        body = orjson.dumps({"reason": bounded(reason), "attempts": attempts, "at": time.time()})
        self._set_outcome(keys.FAILED, key, body)

    @redis_errors
    def mark_rejected(self, key: str, reason: str, record: str = "", sha: str = "") -> None:
        """``sha``: the content rejected; enqueue skips the same content next time."""
        body = orjson.dumps({"reason": bounded(reason), "record": bounded(record, 200),
                             "sha": bounded(sha, 64), "at": time.time()})
        self._set_outcome(keys.REJECTED, key, body)

    def _set_outcome(self, name: str, key: str, body: bytes) -> bool:
        """Record outcome ``name`` of ``key``, unless the sample is done (False then): a done
        sample's file verified on disk, so an outcome arriving after it is a late one."""
        return bool(self.r.eval(_SET_OUTCOME, 4, self.k(keys.DONE), self.k(name),
                                self.k(keys.RUNNING), self.k(keys.RETRYING), key, body))

    @redis_errors
    def mark_retrying(self, key: str, attempt: int, reason: str) -> None:
        """An attempt failed and the sample will be tried again: visible in ``status`` now
        (unless the sample is done: ``_set_outcome``)."""
        body = orjson.dumps({"attempt": attempt, "reason": bounded(reason), "at": time.time()})
        self._set_outcome(keys.RETRYING, key, body)

    @redis_errors
    def mark_stale(self, key: str, reason: str) -> None:
        """The record this message points at changed after enqueue: no outcome; re-enqueue."""
        body = orjson.dumps({"reason": bounded(reason), "at": time.time()})
        self._set_outcome(keys.STALE, key, body)

    @redis_errors
    def record_malformed(self, reason: str) -> None:
        """Remember a refused task message (the newest ``MAX_MALFORMED``), bounded in size."""
        body = orjson.dumps({"reason": bounded(reason), "at": time.time()})
        p = self.r.pipeline()
        p.lpush(self.k(keys.MALFORMED), body)
        p.ltrim(self.k(keys.MALFORMED), 0, MAX_MALFORMED - 1)
        p.execute()

    @redis_errors
    def forget_outcome(self, key: str) -> None:
        """Before a deliberate requeue: clear every outcome, done included (the requeue's
        reason is that its file is missing or failed a check), and the attempts."""
        p = self.r.pipeline()
        p.zrem(self.k(keys.DONE), key)
        for name in (keys.FAILED, keys.REJECTED, keys.ATTEMPTS, keys.STALE, keys.RETRYING,
                     keys.PARKED, *_DONE_NAMES):
            p.hdel(self.k(name), key)
        p.execute()

    def sample_lease(self, key: str, ttl_s: float, deadline: float
                     ) -> AbstractContextManager[leases.Lease | None]:
        """Hold sample ``key``'s lease for a block (``lease.held``: None when another attempt
        kept it until ``deadline``)."""
        return leases.held(self.r, lease_name(self.run_id, key), ttl_s, deadline)

    @redis_errors
    def try_sample_lease(self, key: str, ttl_s: float) -> leases.Lease | str:
        """Sample ``key``'s lease now, or who holds it (``lease.try_acquire``)."""
        return leases.try_acquire(self.r, lease_name(self.run_id, key), ttl_s)

    def run_lock(self, name: str, ttl_s: float, deadline: float
                 ) -> AbstractContextManager[leases.Lease | None]:
        """Hold the run's lock ``name`` (``keys.ENQUEUE_LOCK``, ...) for a block."""
        return leases.held(self.r, self.k(name), ttl_s, deadline)

    @redis_errors
    def try_run_lock(self, name: str, ttl_s: float) -> leases.Lease | str:
        """The run's lock ``name`` now, or who holds it."""
        return leases.try_acquire(self.r, self.k(name), ttl_s)

    @redis_errors
    def run_lock_taken(self, name: str) -> bool:
        return bool(self.r.exists(self.k(name)))

    @redis_errors
    def leased(self, sample_keys: list[str]) -> list[bool]:
        """Whether an attempt holds each sample's lease now (``worker.state.lease``)."""
        p = self.r.pipeline(transaction=False)
        for key in sample_keys:
            p.exists(lease_name(self.run_id, key))
        return [bool(x) for x in p.execute()] if sample_keys else []

    @redis_errors
    def in_question(self, sample_keys: list[str]) -> list[bool]:
        """Whether each sample's file, if any, needs more than its header to count as done:
        the index records a failed attempt of it (failed, retrying), or an attempt holds its
        lease. A header of this run with the record's content is what relearning "done" from
        the disk reads (``enqueue``, a host's registration); a byte flipped in the data keeps
        it, and the attempts that found the file damaged must not be overruled by it."""
        p = self.r.pipeline(transaction=False)
        for key in sample_keys:
            p.hexists(self.k(keys.FAILED), key)
            p.hexists(self.k(keys.RETRYING), key)
            p.exists(lease_name(self.run_id, key))
        got = p.execute() if sample_keys else []
        return [any(got[i : i + 3]) for i in range(0, len(got), 3)]

    @redis_errors
    def set_paused(self, process: str, reason: str | None) -> None:
        """Say that ``process`` (host:pid) waits out ``reason``; None: it works again."""
        if reason is None:
            self.r.hdel(self.k(keys.PAUSED), process)
        else:
            body = orjson.dumps({"reason": bounded(reason), "at": time.time()})
            self.r.hset(self.k(keys.PAUSED), process, body)

    # --- the run's samples and data files ---------------------------------------------------

    @redis_errors
    def register_file(self, path: str) -> int:
        """The data file's id in this run, given on its first enqueue."""
        existing = self.r.hget(self.k(keys.FILES), path)
        if existing is not None:
            return int(existing)
        fid = int(self.r.hincrby(self.k(keys.META), "next_fid", 1))
        if self.r.hsetnx(self.k(keys.FILES), path, fid):
            return fid
        return int(self.r.hget(self.k(keys.FILES), path))  # type: ignore[arg-type]

    @redis_errors
    def data_files(self) -> dict[str, int]:
        """Every data file enqueued for this run: path -> id."""
        return self._ints(keys.FILES)

    @redis_errors
    def registered(self, sample_keys: list[str]) -> list[Registered | None]:
        """Where each of ``sample_keys`` was registered, or None."""
        if not sample_keys:
            return []
        raw = self.r.hmget(self.k(keys.SAMPLES), sample_keys)
        return [None if x is None else Registered.decode(x) for x in raw]

    @redis_errors
    def all_registered(self) -> dict[str, Registered]:
        return dict(self.iter_registered())

    def iter_registered(self) -> Iterator[tuple[str, Registered]]:
        """Every registered sample, streamed (raises redis errors as they come)."""
        for k, v in self.r.hscan_iter(self.k(keys.SAMPLES), count=2000):
            yield as_text(k), Registered.decode(v)

    @redis_errors
    def are_done(self, sample_keys: list[str]) -> list[bool]:
        p = self.r.pipeline(transaction=False)
        for key in sample_keys:
            p.zscore(self.k(keys.DONE), key)
        return [x is not None for x in p.execute()] if sample_keys else []

    @redis_errors
    def register(self, entries: dict[str, Registered]) -> None:
        """Record where each sample's record is now (a record back in the corpus is no
        longer ``removed``)."""
        if entries:
            p = self.r.pipeline()
            p.hset(self.k(keys.SAMPLES), mapping={k: v.encode() for k, v in entries.items()})
            p.hdel(self.k(keys.REMOVED), *entries)
            p.execute()

    @redis_errors
    def unregister(self, sample_keys: Iterable[str], reason: str = "", file: str = "") -> None:
        """Take samples out of the run: their records left the corpus. Each is recorded
        under ``removed`` with ``reason`` and the data file it was in."""
        names = list(sample_keys)
        if not names:
            return
        body = orjson.dumps({"reason": bounded(reason), "file": bounded(file, 1000),
                             "at": time.time()})
        p = self.r.pipeline()
        p.hdel(self.k(keys.SAMPLES), *names)
        p.zrem(self.k(keys.DONE), *names)
        for name in (keys.BYTES, keys.TOKENS, keys.FAILED, keys.REJECTED, keys.ATTEMPTS,
                     keys.TRIES, keys.STALE, keys.RETRYING, keys.PARKED):
            p.hdel(self.k(name), *names)
        p.hset(self.k(keys.REMOVED), mapping=dict.fromkeys(names, body))
        p.execute()

    @redis_errors
    def unmark_done(self, sample_keys: list[str]) -> None:
        """Samples whose file is not theirs any more (missing, damaged, set aside because
        their record was corrected): not done now, held by no host."""
        if sample_keys:
            p = self.r.pipeline()
            p.zrem(self.k(keys.DONE), *sample_keys)
            for name in _DONE_NAMES:
                p.hdel(self.k(name), *sample_keys)
            p.execute()

    @redis_errors
    def done_sizes(self, sample_keys: list[str]) -> list[int | None]:
        """The size each sample's final file had when it was verified (None: not recorded)."""
        if not sample_keys:
            return []
        return [None if x is None else int(x)
                for x in self.r.hmget(self.k(keys.BYTES), sample_keys)]

    @redis_errors
    def done_keys(self) -> set[str]:
        members: list[bytes] = self.r.zrange(self.k(keys.DONE), 0, -1)  # type: ignore[assignment]
        return {as_text(k) for k in members}

    @redis_errors
    def done_between(self, since: float | str, until: float | str = "+inf",
                     limit: int | None = None, newest_first: bool = False
                     ) -> list[tuple[str, float]]:
        """Done samples and when, marked done between the two times (inclusive), oldest first
        (``newest_first``: newest first); at most ``limit`` of them."""
        d, start = self.k(keys.DONE), 0 if limit else None
        got: list[tuple[bytes, float]] = (
            self.r.zrevrangebyscore(d, until, since, start=start, num=limit, withscores=True)
            if newest_first else  # type: ignore[assignment]
            self.r.zrangebyscore(d, since, until, start=start, num=limit, withscores=True))
        return [(as_text(k), float(t)) for k, t in got]

    @redis_errors
    def done_count(self, since: float | str = "-inf", until: float | str = "+inf") -> int:
        """How many samples were marked done between the two times (inclusive)."""
        if since == "-inf" and until == "+inf":
            return int(self.r.zcard(self.k(keys.DONE)))
        return int(self.r.zcount(self.k(keys.DONE), since, until))

    @redis_errors
    def done_at_edge(self, newest: bool) -> float | None:
        """When the first (``newest``: the last) sample still done was marked done."""
        at = -1 if newest else 0
        got: list[tuple[bytes, float]] = self.r.zrange(  # type: ignore[assignment]
            self.k(keys.DONE), at, at, withscores=True)
        return float(got[0][1]) if got else None

    @redis_errors
    def file_sizes(self, sample_keys: list[str]) -> list[int | None]:
        """The final file's size each done sample of ``sample_keys`` was verified at."""
        if not sample_keys:
            return []
        raw: list[bytes | None] = self.r.hmget(  # type: ignore[assignment]
            self.k(keys.BYTES), sample_keys)
        return [None if v is None else int(v) for v in raw]

    @redis_errors
    def settled_keys(self, names: Iterable[str]) -> set[str]:
        """The samples with an entry in any of the hashes ``names`` (outcomes, ``parked``)."""
        p = self.r.pipeline(transaction=False)
        for name in names:
            p.hkeys(self.k(name))
        return {as_text(k) for got in p.execute() for k in got}

    @redis_errors
    def note_republished(self, key: str) -> None:
        """The reconciler published ``key`` again (its message was lost)."""
        self.r.hincrby(self.k(keys.REPUBLISHED), key, 1)

    @redis_errors
    def republished(self) -> dict[str, int]:
        """Sample key -> times the reconciler published it again."""
        return self._ints(keys.REPUBLISHED)

    def _ints(self, name: str) -> dict[str, int]:
        """A hash of counts or ids, read whole."""
        raw: dict[bytes, bytes] = self.r.hgetall(self.k(name))  # type: ignore[assignment]
        return {as_text(k): int(v) for k, v in raw.items()}

    @redis_errors
    def running_bodies(self, sample_keys: list[str]) -> list[bytes | None]:
        """The ``running`` entry of each of ``sample_keys`` as stored (None: none)."""
        if not sample_keys:
            return []
        return list(self.r.hmget(self.k(keys.RUNNING), sample_keys))  # type: ignore[arg-type]

    @redis_errors
    def refund_running(self, key: str, body: bytes | str) -> bool:
        """Take back the attempt whose ``running`` entry is still ``body`` (``_REFUND``)."""
        return bool(self.r.eval(_REFUND, 2, self.k(keys.RUNNING), self.k(keys.ATTEMPTS),
                                key, body))

    @redis_errors
    def add_invalid(self, fid: int, where: str, reason: str) -> None:
        """A record enqueue refused (no sample key): counted in the run, never published."""
        self.r.hset(self.k(keys.REJECTED), f"@{fid}:{bounded(where, 100)}",
                    orjson.dumps({"reason": bounded(reason), "record": bounded(where, 200),
                                  "sha": "", "at": time.time()}))

    @redis_errors
    def clear_invalid(self, fid: int) -> None:
        """Before a file is enqueued again: its refused records are counted anew."""
        prefix = f"@{fid}:"
        names = [k for k in self.r.hkeys(self.k(keys.REJECTED))
                 if as_text(k).startswith(prefix)]
        if names:
            self.r.hdel(self.k(keys.REJECTED), *names)

    @redis_errors
    def next_publication(self) -> int:
        """A fresh number for one ``enqueue`` or ``requeue`` call: part of its task ids.

        The count starts at the current time in ms, so a run whose Redis lost its data
        does not publish under numbers (hence task ids) a monitor's history already holds.
        ``published_at`` is when the run was last given work: a stall is measured from it.
        """
        p = self.r.pipeline()
        p.hsetnx(self.k(keys.META), "publications", int(time.time() * 1000))
        p.hincrby(self.k(keys.META), "publications", 1)
        p.hset(self.k(keys.META), "published_at", repr(time.time()))
        return int(p.execute()[1])

    @redis_errors
    def set_meta(self, **fields: Any) -> None:
        self.r.hset(self.k(keys.META), mapping={k: str(v) for k, v in fields.items()})

    @redis_errors
    def meta(self) -> dict[str, str]:
        raw: dict[bytes, bytes] = self.r.hgetall(self.k(keys.META))  # type: ignore[assignment]
        return {as_text(k): as_text(v) for k, v in raw.items()}

    @redis_errors
    def outcomes(self, name: str) -> dict[str, dict[str, Any]]:
        """``failed``, ``rejected``, ``retrying``, ``stale``, ``running`` or ``paused``
        entries: key -> their JSON body."""
        raw: dict[bytes, bytes] = self.r.hgetall(self.k(name))  # type: ignore[assignment]
        return {as_text(k): orjson.loads(v) for k, v in raw.items()}

    @redis_errors
    def counts(self) -> Counts:
        p = self.r.pipeline()
        p.hlen(self.k(keys.SAMPLES))
        p.zcard(self.k(keys.DONE))
        p.hlen(self.k(keys.FAILED))
        p.hlen(self.k(keys.REJECTED))
        p.hlen(self.k(keys.STALE))
        p.hlen(self.k(keys.RETRYING))
        p.hlen(self.k(keys.RUNNING))
        p.hvals(self.k(keys.BYTES))
        p.hvals(self.k(keys.TOKENS))
        p.hlen(self.k(keys.PARKED))
        p.hlen(self.k(keys.REMOVED))
        (samples, done, failed, rejected, stale, retrying, running, sizes, tokens, parked,
         removed) = p.execute()
        invalid = sum(1 for k in self.r.hkeys(self.k(keys.REJECTED))
                      if as_text(k).startswith("@"))
        return Counts(total=samples + invalid, done=done, failed=failed, rejected=rejected,
                      stale=stale, retrying=retrying, running=running,
                      bytes=sum(int(x) for x in sizes), tokens=sum(int(x) for x in tokens),
                      parked=parked, removed=removed)


@redis_errors
def every_runs_outcomes(r: redis.Redis) -> tuple[int, int]:
    """(samples done, samples failed or rejected) over every run this Redis holds."""
    runs = [as_text(k).rsplit(":", 1)[0] for k in r.scan_iter(keys.run_key("*", keys.META))]
    done = sum(int(r.zcard(f"{run}:{keys.DONE}")) for run in runs)
    bad = sum(int(r.hlen(f"{run}:{n}")) for run in runs
              for n in (keys.FAILED, keys.REJECTED))
    return done, bad
