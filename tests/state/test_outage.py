"""The outage watch refunds the attempts a Redis outage cancelled, and only those: the ones it
saw running, and the ones this worker's pool began after its last look at Redis (the gap of
one PING interval a SIGKILLed Redis fell into); never an attempt begun after Redis came back,
another worker's, or one still running. Real Redis; Celery's state is given, not read."""

from __future__ import annotations

import time

import pytest
import redis

from producer.localfarm.farm import free_port
from worker.state import keys
from worker.state.index import RunIndex
from worker.steps.outage import Watch

RUN = "run-a"


class Outage:
    """A watch whose Redis can be taken away and given back (its client pointed at a port
    where nothing listens, then at the tier's Redis again)."""

    def __init__(self, redis_url: str, running: set[str]) -> None:
        self.real = redis.Redis.from_url(redis_url)
        self.dead = redis.Redis(port=free_port(), socket_connect_timeout=0.2)
        self.running = running
        self.watch = Watch(self.real, RUN, host="h", pool_pids=lambda: {11, 12},
                           running=lambda run_id: set(self.running))

    def set_redis(self, r: redis.Redis) -> None:
        self.watch.r = self.watch.index.r = r


def attempts(r: redis.Redis, key: str) -> int:
    return int(r.hget(keys.run_key(RUN, keys.ATTEMPTS), key) or 0)


@pytest.mark.timeout(20)
def test_an_outage_refunds_the_attempts_it_cancelled_seen_or_begun_since_the_last_look(
        redis_url: str) -> None:
    o = Outage(redis_url, running={"seen"})
    index = RunIndex(o.real, RUN)
    # Given an attempt running when the watch last saw Redis
    for key, worker in (("seen", "h:11"), ("gap", "h:12"), ("other", "h2:12"),
                        ("alive", "h:11")):
        index.next_attempt(key)
        if key == "seen":
            index.mark_running(key, worker, 1)
    assert o.watch.tick() == 0 and set(o.watch.remembered) == {"seen"}
    # And three begun after it: one by this worker's pool (the gap), one by another host's
    # worker, one that still runs here when Redis is back
    index.mark_running("gap", "h:12", 1)
    index.mark_running("other", "h2:12", 1)
    index.mark_running("alive", "h:11", 1)
    # When Redis goes away (Celery cancels what ran), and comes back
    o.set_redis(o.dead)
    assert o.watch.tick() == 0 and o.watch.away
    time.sleep(0.01)
    o.running = {"alive"}
    index.next_attempt("fresh")  # begun since Redis came back: newer than the outage
    index.mark_running("fresh", "h:12", 1)
    o.set_redis(o.real)
    refunded = o.watch.tick()
    # Then the cancelled attempts of this worker are refunded, each once; the others stand
    assert refunded == 2, index.outcomes(keys.RUNNING)
    assert (attempts(o.real, "seen"), attempts(o.real, "gap")) == (0, 0)
    assert attempts(o.real, "other") == attempts(o.real, "alive") == attempts(o.real, "fresh") == 1
    assert set(index.outcomes(keys.RUNNING)) == {"other", "alive", "fresh"}
    assert o.watch.tick() == 0 and not o.watch.away
