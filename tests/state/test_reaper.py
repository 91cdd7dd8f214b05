"""The reaper returns a gone owner's message only while it is still that owner's delivery:
a message another reaper already returned, and a live worker received again under the same
delivery tag, stays with its new receiver; and an owner is gone by our /proc only on its own
machine, elsewhere by its heartbeat. Real Redis."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from producer.localfarm.farm import LocalFarm
from tests.conftest import CACHE
from worker.core import liveness
from worker.state import keys, owners


def test_a_redelivered_message_is_not_returned_for_its_old_owner(
        tmp_path: Path, redis_url: str) -> None:
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, redis_url=redis_url)
    try:
        r = farm.redis()
        # Given a message of a worker that died, delivered a while ago
        r.hset(keys.OWNERS, "T", "host:1:dead")
        r.zadd(keys.KOMBU_UNACKED_INDEX, {"T": time.time() - 10})
        assert owners.still_theirs(r, "T", "host:1:dead")
        # When another reaper returned it and a live worker has just received it again: the
        # fresh delivery (its receiver records itself a few ms later) is not the dead one's
        r.zadd(keys.KOMBU_UNACKED_INDEX, {"T": time.time()})
        assert not owners.still_theirs(r, "T", "host:1:dead")
        # And once the receiver has recorded itself, the message is its, whatever its age
        r.hset(keys.OWNERS, "T", "host:2:alive")
        r.zadd(keys.KOMBU_UNACKED_INDEX, {"T": time.time() - 10})
        assert not owners.still_theirs(r, "T", "host:1:dead")
        # And a message acknowledged meanwhile is nobody's to return
        r.zrem(keys.KOMBU_UNACKED_INDEX, "T")
        assert not owners.still_theirs(r, "T", "host:2:alive")
    finally:
        farm.close(kill=True)


def test_an_owner_is_judged_from_proc_only_on_its_own_machine(
        tmp_path: Path, redis_url: str) -> None:
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, redis_url=redis_url)
    try:
        r = farm.redis()
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        # Given owners whose pid no longer runs here: one of this machine, one of another
        # machine with our hostname, one of an older worker (host:pid:start, no machine)
        gone_here = f"{liveness.HOST}:{proc.pid}:1:{liveness.MACHINE}"
        elsewhere = f"{liveness.HOST}:{proc.pid}:1:0123456789abcdef-1"
        older = f"{liveness.HOST}:{proc.pid}:1"
        # When each still beats its heartbeat
        for owner in (gone_here, elsewhere, older):
            r.set(owners.heartbeat_key(owner), "1", ex=60)
        # Then only the one of this machine is gone; the others live while they beat
        assert owners.is_gone(r, gone_here)
        assert not owners.is_gone(r, elsewhere) and not owners.is_gone(r, older)
        # And once their heartbeat expires, they are gone too
        r.delete(owners.heartbeat_key(elsewhere), owners.heartbeat_key(older))
        assert owners.is_gone(r, elsewhere) and owners.is_gone(r, older)
        # And this live process is not, with or without a heartbeat
        assert not owners.is_gone(r, liveness.identity())
    finally:
        farm.close(kill=True)
