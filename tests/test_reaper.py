"""The reaper returns a gone owner's message only while it is still that owner's delivery:
a message another reaper already returned, and a live worker received again under the same
delivery tag, stays with its new receiver. Real Redis."""

from __future__ import annotations

import time
from pathlib import Path

from producer.localfarm import LocalFarm
from tests.conftest import CACHE
from worker import keys, reaper


def test_a_redelivered_message_is_not_returned_for_its_old_owner(tmp_path: Path) -> None:
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE)
    try:
        farm.start_redis()
        r = farm.redis()
        # Given a message of a worker that died, delivered a while ago
        r.hset(keys.OWNERS, "T", "host:1:dead")
        r.zadd(keys.KOMBU_UNACKED_INDEX, {"T": time.time() - 10})
        assert reaper._still_theirs(r, "T", "host:1:dead")
        # When another reaper returned it and a live worker has just received it again: the
        # fresh delivery (its receiver records itself a few ms later) is not the dead one's
        r.zadd(keys.KOMBU_UNACKED_INDEX, {"T": time.time()})
        assert not reaper._still_theirs(r, "T", "host:1:dead")
        # And once the receiver has recorded itself, the message is its, whatever its age
        r.hset(keys.OWNERS, "T", "host:2:alive")
        r.zadd(keys.KOMBU_UNACKED_INDEX, {"T": time.time() - 10})
        assert not reaper._still_theirs(r, "T", "host:1:dead")
        # And a message acknowledged meanwhile is nobody's to return
        r.zrem(keys.KOMBU_UNACKED_INDEX, "T")
        assert not reaper._still_theirs(r, "T", "host:2:alive")
    finally:
        farm.close(kill=True)
