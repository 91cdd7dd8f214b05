"""The per-sample lease (worker/state/lease.py) against a real Redis: who gets it, who waits,
when it is taken over, and when its holder must stop trusting it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis

from worker.core import liveness
from worker.core.errors import LeaseLost
from worker.state import lease

NAME = lease.lease_name("f" * 16, "sample-1")


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _dead_holder() -> str:
    """The identity of a process of this machine that has exited."""
    out = subprocess.run([sys.executable, "-c",
                          "from worker.core import liveness; print(liveness.identity())"],
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip()


def test_the_first_attempt_takes_the_lease_and_a_second_is_told_who_holds_it(
        r: redis.Redis) -> None:
    # Given a lease taken
    first = lease.try_acquire(r, NAME, ttl_s=5)
    assert isinstance(first, lease.Lease)
    try:
        # When another attempt asks, Then it gets the holder's identity, not the lease
        second = lease.try_acquire(r, NAME, ttl_s=5)
        assert second == first.token == lease.holder(r, NAME)
        assert first.token.startswith(liveness.identity() + "#")
    finally:
        first.release()
    # And once released it is free: nobody holds it, the next attempt gets it
    assert lease.holder(r, NAME) is None
    third = lease.try_acquire(r, NAME, ttl_s=5)
    assert isinstance(third, lease.Lease)
    third.release()


def test_the_key_is_the_runs_and_the_samples(r: redis.Redis) -> None:
    assert lease.lease_name("a" * 16, "k1") != lease.lease_name("b" * 16, "k1")
    assert lease.lease_name("a" * 16, "k1") != lease.lease_name("a" * 16, "k2")
    got = lease.try_acquire(r, lease.lease_name("a" * 16, "k1"), ttl_s=5)
    assert isinstance(got, lease.Lease)
    try:  # another run's lease of the same key is another lease
        other = lease.try_acquire(r, lease.lease_name("b" * 16, "k1"), 5)
        assert isinstance(other, lease.Lease)
        other.release()
    finally:
        got.release()


def test_a_holder_gone_from_this_machine_is_taken_over_a_living_one_is_not(
        r: redis.Redis) -> None:
    # Given the lease held by a process of this machine that has exited
    r.set(NAME, f"{_dead_holder()}#abc", px=60_000)
    # When an attempt asks, Then it takes the lease over at once, with its own token
    got = lease.try_acquire(r, NAME, ttl_s=5)
    assert isinstance(got, lease.Lease) and lease.holder(r, NAME) == got.token
    got.release()
    # And a holder of this machine that runs (this process) keeps it
    r.set(NAME, f"{liveness.identity()}#abc", px=60_000)
    assert lease.try_acquire(r, NAME, ttl_s=5) == f"{liveness.identity()}#abc"


def test_a_holder_of_another_machine_keeps_it_until_its_ttl_runs_out(r: redis.Redis) -> None:
    # Given a lease of another machine's process (this one cannot tell whether it lives)
    r.set(NAME, "otherhost.m0123456789abcdef-1.4242.123#abc", px=400)
    # Then it is not taken over while its TTL runs
    assert lease.try_acquire(r, NAME, ttl_s=5) == "otherhost.m0123456789abcdef-1.4242.123#abc"
    # And after it, Redis dropped it: the next attempt gets the lease
    time.sleep(0.6)
    got = lease.try_acquire(r, NAME, ttl_s=5)
    assert isinstance(got, lease.Lease)
    got.release()


def test_the_holder_renews_it_past_its_ttl(r: redis.Redis) -> None:
    # Given a lease of a 0.6 s TTL, renewed every third of it
    got = lease.try_acquire(r, NAME, ttl_s=0.6)
    assert isinstance(got, lease.Lease)
    try:
        # When twice its TTL passes, Then it is still this holder's, and trusted
        time.sleep(1.2)
        assert lease.holder(r, NAME) == got.token
        got.check()
        assert 0 < r.pttl(NAME) <= 600
    finally:
        got.release()


def test_a_holder_whose_lease_was_taken_learns_it_and_writes_nothing(r: redis.Redis) -> None:
    # Given a held lease that someone else's attempt took meanwhile (it stalled past its TTL)
    got = lease.try_acquire(r, NAME, ttl_s=0.6)
    assert isinstance(got, lease.Lease)
    try:
        r.set(NAME, "otherhost.m0123456789abcdef-1.4242.123#new", px=60_000)
        # When its renewal finds another token, Then check raises LeaseLost
        time.sleep(0.5)
        with pytest.raises(LeaseLost, match="was lost"):
            got.check()
    finally:
        got.release()
    # And its release removes nothing of the new holder's
    assert lease.holder(r, NAME) == "otherhost.m0123456789abcdef-1.4242.123#new"


def test_a_holder_that_cannot_renew_stops_trusting_it_before_it_expires(
        r: redis.Redis) -> None:
    # Given a held lease whose renewals fail (Redis unreachable for this holder)
    got = lease.try_acquire(r, NAME, ttl_s=0.8)
    assert isinstance(got, lease.Lease)
    got.r = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.05)
    try:
        # When its TTL less the trust margin passes, Then check refuses (another host may
        # hold the sample by then)
        time.sleep(0.8 * (1 - lease.TRUST_MARGIN) + 0.1)
        assert got.trusted_for_s() < 0
        with pytest.raises(LeaseLost, match="not renewed"):
            got.check()
    finally:
        got.release()  # its release cannot reach Redis either: it expires by its TTL


def test_held_waits_for_the_holder_then_gives_up_at_the_deadline(r: redis.Redis) -> None:
    # Given a lease held by another machine's process for 0.5 s more
    r.set(NAME, "otherhost.m0123456789abcdef-1.4242.123#abc", px=500)
    # When an attempt waits for it with a deadline past that, Then it gets it once free
    with lease.held(r, NAME, ttl_s=5, deadline=time.monotonic() + 5, poll_s=0.1) as got:
        assert isinstance(got, lease.Lease) and lease.holder(r, NAME) == got.token
    assert lease.holder(r, NAME) is None  # released at the block's end
    # And with a deadline before the holder lets go, it gets None and holds nothing
    r.set(NAME, "otherhost.m0123456789abcdef-1.4242.123#abc", px=60_000)
    t0 = time.monotonic()
    with lease.held(r, NAME, ttl_s=5, deadline=t0 + 0.4, poll_s=0.1) as none:
        assert none is None
    assert time.monotonic() - t0 < 2
    assert lease.holder(r, NAME) == "otherhost.m0123456789abcdef-1.4242.123#abc"
