"""Who holds each task message: the owner record (``hsfarm:owners``, delivery tag -> worker
main process) and each main process's heartbeat, in Redis.

``worker.request.OwnedRequest`` records and forgets its deliveries here; the reaper
(``worker.steps.reaper``) reads them to bring a gone owner's messages back.
Test: tests/state/test_reaper.py."""

from __future__ import annotations

import time

from worker.core import liveness
from worker.core.settings import Settings
from worker.state import broker, keys, queue_scan
from worker.state.broker import Client, redis_errors

DELIVERY_SETTLE_S = 2.0  # a delivery this fresh may not have recorded its owner yet
# Forget an owner entry only while it still names that owner (another worker may own the tag
# by now: the same message, delivered again).
_FORGET = "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then " \
          "return redis.call('HDEL', KEYS[1], ARGV[1]) else return 0 end"

_CLIENTS: dict[str, Client] = {}


def client_for(settings: Settings) -> Client:
    """One client per Redis URL in this process, shared by the steps and each request."""
    client = _CLIENTS.get(settings.redis_url)
    if client is None:
        client = _CLIENTS[settings.redis_url] = broker.client(settings, socket_timeout_s=10)
    return client


def heartbeat_key(owner: str) -> str:
    return f"{keys.HEARTBEAT}:{owner}"


@redis_errors
def beat(r: Client, settings: Settings) -> None:
    """Say that this worker main process is alive (for ``heartbeat_ttl_s``)."""
    r.set(heartbeat_key(liveness.identity()), "1", ex=max(1, int(settings.heartbeat_ttl_s)))


@redis_errors
def stop_beating(r: Client) -> None:
    """This worker main process stops: its heartbeat goes at once."""
    r.delete(heartbeat_key(liveness.identity()))


@redis_errors
def is_gone(r: Client, owner: str) -> bool:
    """A worker of this machine: its process no longer runs. Anywhere else (another boot or
    pid namespace, whatever its hostname), or an identity that does not say where it ran:
    its heartbeat expired."""
    if liveness.on_this_machine(owner):
        return liveness.gone_here(owner)
    return not r.exists(heartbeat_key(owner))


@redis_errors
def alive(r: Client) -> list[str]:
    """Identities of the worker main processes whose heartbeat is alive (every run's)."""
    prefix = f"{keys.HEARTBEAT}:"
    found = (_text(k) for k in r.scan_iter(f"{prefix}*", count=1000))
    return sorted(k[len(prefix):] for k in found)


@redis_errors
def owners(r: Client) -> dict[str, str]:
    """Delivery tag -> the worker main process that recorded it as its own."""
    raw: dict[bytes, bytes] = r.hgetall(keys.OWNERS)  # type: ignore[assignment]
    return {_text(t): _text(o) for t, o in raw.items()}


@redis_errors
def record(r: Client, tag: str) -> None:
    """This worker main process holds the message of ``tag``."""
    r.hset(keys.OWNERS, tag, liveness.identity())


@redis_errors
def forget(r: Client, tag: str, owner: str) -> None:
    r.eval(_FORGET, 1, keys.OWNERS, tag, owner)


@redis_errors
def forget_if_settled(r: Client, tag: str) -> None:
    """After an acknowledgement or a hand-back: forget the message, unless it is still
    unacknowledged (kombu logs and swallows a failed ack while Redis is away); then it stays
    ours, and the reaper returns it once Redis answers, since we no longer hold it."""
    if not queue_scan.is_unacked(r, tag):
        forget(r, tag, liveness.identity())


@redis_errors
def still_theirs(r: Client, tag: str, owner: str) -> bool:
    """Read again just before restoring: is the message still ``owner``'s delivery?

    Between the reading of the owners and now, another reaper may have restored it and a live
    worker received it again (same delivery tag): kombu records that delivery a few ms before
    the receiver records itself as the owner, and restoring it would put a second copy of a
    running sample in the queue. A delivery younger than ``DELIVERY_SETTLE_S`` is left to the
    next round, when its owner is known.
    """
    current = r.hget(keys.OWNERS, tag)
    at = queue_scan.delivered_at(r, tag)
    return (current is not None and _text(current) == owner and at is not None
            and time.time() - at >= DELIVERY_SETTLE_S)


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
