"""Host-wide admission: how many requests are in flight to the server, and tmpfs for their dumps.

Every worker process of a host takes a ticket before a request: a place among
``max_in_flight`` and room for its dump in the tmpfs budget, held by an ``flock`` on its slot
file in ``<dump_dir>/.hsfarm-slots/``, so a SIGKILLed worker never leaks them. Room is first
come, first served (a request fits beside the oldest waiter or waits), so a 64k-token dump is
never starved by short ones. Under DP attention a ticket also names its group (``dp_routing``).
Test: tests/unit/test_admission.py::test_a_big_request_is_admitted_while_small_ones_keep_coming."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_dump import dumpfile
from engine_dump.engines import dp_groups
from worker.core import dumps
from worker.core.errors import BadInput, NoSpace, ServerMisconfigured, Transient
from worker.core.settings import Settings
from worker.core.units import size_text
from worker.server.client import ServerClient
from worker.server.dp_routing import NO_GROUP, SERVER, choose_group

SLOT_DIR = ".hsfarm-slots"
GEN_SLOT_DIR = ".hsfarm-gen-slots"  # a regenerating run's generations: their own places
DEFAULT_GEN_IN_FLIGHT = 64  # generations at once where the server does not say its most
MAX_SLOTS = 256  # worker processes per host that may hold a ticket at once
TYPICAL_SAMPLE_TOKENS = 2048  # the reference run's samples: 1.5–2k tokens
DEFAULT_MAX_IN_FLIGHT = 8  # the least, and what applies when the server does not tell
_POLL_S = (0.005, 0.01, 0.02, 0.05)


class NoPlace(Transient):
    """No ticket within the wait: the host's places were all taken for that long."""


@dataclass(frozen=True)
class Limits:
    max_in_flight: int
    dump_budget_bytes: int
    bytes_per_token: int
    source: str  # where the values came from, for status and logs
    dp_groups: int = 1  # the server's attention-DP groups, each with its own scheduler
    dump_fs_bytes: int = 0  # the dump dir's file system, in all (0: not known)

    def describe(self) -> str:
        if self.dp_groups > 1:
            per = self.max_in_flight / self.dp_groups
            return (f"in-flight max {self.max_in_flight} ({per:g} per DP group × "
                    f"{self.dp_groups} DP groups), dump budget "
                    f"{size_text(self.dump_budget_bytes)} for the host ({self.source})")
        return (f"in-flight max {self.max_in_flight}, dump budget "
                f"{size_text(self.dump_budget_bytes)} ({self.source})")


def dump_bytes_per_token(hidden_size: int, dtype: str = dumpfile.DTYPE_BF16) -> int:
    """One token of a dump: its id (int64), the final state and 3 aux states (bf16, or fp8
    with their scales)."""
    return dumpfile.bytes_per_token(dtype, hidden_size)


def resolve_limits(settings: Settings, hidden_size: int, server_info: dict[str, Any] | None,
                   dump_fs_bytes: int | None) -> Limits:
    """The effective limits: the settings where set, else sized from the server and tmpfs.

    In flight: per scheduler (each DP group is one; ``/server_info``'s chunk is the group's),
    queued tokens for two forward passes (2 × chunked prefill size / 2048-token samples), at
    least 8, capped by the server's ``max_running_requests``. Dump budget: every in-flight
    request at the longest length, at most half the dump dir's file system (one tmpfs a host).
    """
    per_token = dump_bytes_per_token(hidden_size, settings.hidden_dtype)
    info = server_info or {}
    groups = dp_groups(info)
    sources = []
    in_flight = settings.max_in_flight
    if in_flight <= 0:
        chunk = info.get("chunked_prefill_size")
        if isinstance(chunk, int) and chunk > 0:
            in_flight = groups * max(DEFAULT_MAX_IN_FLIGHT,
                                     math.ceil(2 * chunk / TYPICAL_SAMPLE_TOKENS))
            cap = info.get("max_running_requests")
            in_flight = min(in_flight, cap) if isinstance(cap, int) and cap > 0 else in_flight
            sources.append("in-flight from /server_info")
        else:
            in_flight = groups * DEFAULT_MAX_IN_FLIGHT
            sources.append("in-flight default")
    budget = settings.dump_budget_bytes
    if budget <= 0:
        budget = in_flight * settings.max_tokens * per_token
        if dump_fs_bytes:
            budget = min(budget, dump_fs_bytes // 2)
        sources.append("budget from max tokens and tmpfs size")
    return Limits(in_flight, budget, per_token, "; ".join(sources) or "settings", groups,
                  dump_fs_bytes or 0)


def limits_for_host(settings: Settings, hidden_size: int, timeout_s: float = 10.0,
                    writer: str | None = None) -> Limits:
    """``host_limits`` from synchronous code, with its own short-lived HTTP client; ``writer``:
    the server start whose ready marker is read (``ServerClient``)."""
    async def ask() -> Limits:
        client = ServerClient.of(settings, timeout_s, writer)
        try:
            return await host_limits(settings, hidden_size, client)
        finally:
            await client.close()

    return asyncio.run(ask())


async def host_limits(settings: Settings, hidden_size: int, client: ServerClient) -> Limits:
    """``resolve_limits`` with this host's server (if it answers) and dump dir."""
    try:
        info: dict[str, Any] | None = await client.server_info()
    except (Transient, BadInput):
        info = None
    try:
        st = os.statvfs(settings.dump_dir)
        fs_bytes: int | None = st.f_blocks * st.f_frsize
    except OSError:
        fs_bytes = None
    return resolve_limits(settings, hidden_size, info, fs_bytes)


def generation_limits(settings: Settings, server_info: dict[str, Any] | None) -> Limits:
    """A regenerating run's places for generations, apart from the prefills' (they dump
    nothing): decode wants many requests at once where prefill wants few. From
    ``FARM_GEN_MAX_IN_FLIGHT``, else the server's ``max_running_requests``, else 64."""
    info = server_info or {}
    in_flight, source = settings.gen_max_in_flight, "settings"
    cap = info.get("max_running_requests")
    if in_flight <= 0 and isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
        in_flight, source = cap, "generations from /server_info's max_running_requests"
    elif in_flight <= 0:
        in_flight, source = DEFAULT_GEN_IN_FLIGHT, "generations default"
    return Limits(min(in_flight, MAX_SLOTS), 0, 0, source, dp_groups(info))


@dataclass(frozen=True)
class Holding:
    """What one slot holds: a request place (0/1), dump bytes, and the DP group its request
    is pinned to (``NO_GROUP``: none); or, while ``waiting_since_ns`` is set
    (``time.monotonic_ns``, one clock for the host), what it waits for."""

    requests: int
    dump_bytes: int
    group: int = NO_GROUP
    waiting_since_ns: int = 0

    def encode(self) -> bytes:
        return f"{self.requests} {self.dump_bytes} {self.group} {self.waiting_since_ns}\n".encode()

    @classmethod
    def decode(cls, raw: bytes) -> Holding:
        try:
            r, b, *rest = (int(x) for x in raw.split()[:4])
            return cls(r, b, *rest)
        except (ValueError, TypeError):
            return cls(0, 0)  # a slot being written for the first time holds nothing yet

    def plus(self, other: Holding) -> Holding:
        return Holding(self.requests + other.requests, self.dump_bytes + other.dump_bytes)


@dataclass
class _Scan:
    """The slots of the host at one moment (under the lock)."""

    held: Holding  # what all held slots hold together
    slots: list[Holding]  # each held slot (for the DP group choice)
    waiters: list[Holding]
    free_fd: int | None
    free_index: int


class Ticket:
    """A held slot. ``answered`` gives the request place back, ``release`` everything."""

    def __init__(self, admission: Admission, fd: int, holding: Holding) -> None:
        self.admission = admission
        self.fd = fd
        self.holding = holding

    @property
    def dp_rank(self) -> int | None:
        """The DP group to pin the request to (SGLang's ``routed_dp_rank``); None: no pin."""
        return None if self.holding.group == NO_GROUP else self.holding.group

    def answered(self) -> None:
        if self.fd >= 0 and self.holding.requests:
            with self.admission.locked():
                self.holding = Holding(0, self.holding.dump_bytes, self.holding.group)
                _write(self.fd, self.holding)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # drops the flock: the slot is free
            self.fd = -1


class Admission:
    """The host's slots in ``dump_dir``; ``admit`` waits for a ticket."""

    def __init__(self, dump_dir: Path, limits: Limits, wait_s: float,
                 slots: int = MAX_SLOTS, dp_routing: str = SERVER,
                 slot_dir: str = SLOT_DIR) -> None:
        self.dir = dump_dir / slot_dir
        self.limits = limits
        self.wait_s = wait_s
        self.slots = slots
        self.dp_routing = dp_routing
        self.dir.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def admit(self, tokens: int) -> Iterator[Ticket]:
        """Hold a request place and room for a dump of ``tokens`` tokens.

        Raises:
            NoSpace: (``never_fits``) the dump is larger than the dump dir's file system.
            Transient: no ticket within ``wait_s`` (the host is saturated for that long).
        """
        want = Holding(1, tokens * self.limits.bytes_per_token)
        self._check_it_can_fit(tokens, want.dump_bytes)
        ticket = self._wait_for(want)
        try:
            yield ticket
        finally:
            ticket.release()

    def _check_it_can_fit(self, tokens: int, dump_bytes: int) -> None:
        fs_bytes = self.limits.dump_fs_bytes
        if not fs_bytes or dump_bytes <= fs_bytes:
            return
        fits_tokens = fs_bytes // self.limits.bytes_per_token
        raise NoSpace(
            f"a dump of {tokens} tokens needs {size_text(dump_bytes)}; the dump dir's file "
            f"system holds {size_text(fs_bytes)} in all. Mount a larger tmpfs (mount -o "
            f"remount,size={math.ceil(dump_bytes * 1.25 / 2**30)}G <dump dir's mount>, on the "
            f"server's host too) or set FARM_MAX_TOKENS to at most {fits_tokens} (another "
            "run), then enqueue --retry-failed",
            need_bytes=dump_bytes, never_fits=True)

    def _wait_for(self, want: Holding) -> Ticket:
        deadline = time.monotonic() + self.wait_s
        line = _Place(time.monotonic_ns())
        try:
            for i in itertools.count():
                ticket = self._try_take(want, line)
                if ticket is not None:
                    return ticket
                if time.monotonic() > deadline:
                    raise NoPlace(f"no admission within {self.wait_s:.0f}s "
                                    f"({self.limits.describe()}; in use: {self.usage()})")
                time.sleep(_POLL_S[min(i, len(_POLL_S) - 1)])
        except BaseException:
            line.leave()
            raise
        raise AssertionError("unreachable")  # itertools.count never ends

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The slots' lock. The dump dir gone (deleted, its tmpfs unmounted), before or while
        it is held, is the server's fault: ``ServerMisconfigured``, which pauses the worker
        and spends no attempt."""
        try:
            fd = self._open_lock()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)
        except FileNotFoundError as e:
            if self.dir.parent.is_dir():
                raise
            raise ServerMisconfigured(dumps.dump_dir_gone(self.dir.parent)) from e

    def _open_lock(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            return os.open(self.dir / "lock", flags, 0o600)
        except FileNotFoundError:  # the dump dir was made again: its slot dir too (never the
            self.dir.mkdir(exist_ok=True)  # dump dir itself: that is the server's user's)
            return os.open(self.dir / "lock", flags, 0o600)

    def _try_take(self, want: Holding, line: _Place) -> Ticket | None:
        """A ticket if ``want`` fits beside what is held and the oldest waiter before it;
        else ``line`` keeps (or takes) a waiting slot, so later requests leave room for it."""
        with self.locked():
            scan = self._scan(keep_free=line.fd < 0, skip=line.index)
            try:
                ahead = [w for w in scan.waiters if w.waiting_since_ns < line.since_ns]
                oldest = min(ahead, key=lambda w: w.waiting_since_ns, default=None)
                fits = self._fits(scan.held if oldest is None else scan.held.plus(oldest), want,
                                  alone=oldest is None)
                if line.fd < 0:
                    if scan.free_fd is None:
                        return None  # every slot is held: wait without a place in line
                    line.fd, line.index, scan.free_fd = scan.free_fd, scan.free_index, None
                if fits:
                    fd, line.fd = line.fd, -1
                    group = choose_group(self.dp_routing, self.limits.dp_groups, scan.slots)
                    want = Holding(want.requests, want.dump_bytes, group)
                    _write(fd, want)
                    return Ticket(self, fd, want)
                _write(line.fd, Holding(want.requests, want.dump_bytes,
                                        waiting_since_ns=line.since_ns))
                return None
            finally:
                if scan.free_fd is not None:
                    os.close(scan.free_fd)

    def _fits(self, held: Holding, want: Holding, alone: bool) -> bool:
        """Room for ``want`` beside ``held``; with nothing held (and no one waiting before
        it), a request larger than the whole budget fits, so it never waits forever."""
        return (held.requests + want.requests <= self.limits.max_in_flight
                and (held.dump_bytes + want.dump_bytes <= self.limits.dump_budget_bytes
                     or (alone and held.dump_bytes == 0)))

    def usage(self) -> Holding:
        """What all held slots hold together, now (waiters hold nothing yet)."""
        with self.locked():
            return self._scan(keep_free=False).held

    def _scan(self, keep_free: bool, skip: int = -1) -> _Scan:
        """Sum of held slots, the waiting ones, and (if asked) a free slot's fd, locked by us.

        ``skip`` is the caller's own slot (its flock would read as another process's).
        """
        held, slots, waiters = Holding(0, 0), [], []
        free_fd: int | None = None
        free_index = -1
        for i in range(self.slots):
            path = self.dir / f"slot-{i:03d}"
            if i == skip:
                continue
            if not path.exists() and (free_fd is not None or not keep_free):
                break  # slots are created in order: none after the first missing one
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held by a live process: count what it holds
                h = Holding.decode(os.pread(fd, 64, 0))
                if h.waiting_since_ns:
                    waiters.append(h)
                else:
                    held = held.plus(h)
                    slots.append(h)
                os.close(fd)
                continue
            if keep_free and free_fd is None:
                free_fd, free_index = fd, i
            else:
                os.close(fd)
        return _Scan(held, slots, waiters, free_fd, free_index)


@dataclass
class _Place:
    """A request's place in the line for room: its waiting slot, once it has one."""

    since_ns: int
    fd: int = -1
    index: int = -1

    def leave(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write(fd: int, holding: Holding) -> None:
    raw = holding.encode()
    os.pwrite(fd, raw, 0)
    os.ftruncate(fd, len(raw))
