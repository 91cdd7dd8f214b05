"""Security on a real farm: JSON-only messages (a pickle is refused, never run), and a crafted
task message deletes nothing, no file outside the output directory.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from kombu import Connection, Exchange, Producer, Queue

from producer.localfarm.farm import wait_until
from tests.support.faults import running_farm, send_task
from worker.state import keys
from worker.state.queue_scan import broker_depth


class _Evil:
    """Unpickling this would create a file: proof of code execution if it ever appears."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (Path.touch, (self.marker,))


def test_pickle_message_is_refused_and_never_executed(tmp_path: Path, tiny_model: Path) -> None:
    marker = tmp_path / "pwned"
    with running_farm(tmp_path) as farm:
        farm.start_worker("w1", concurrency=1)
        # Given a message serialized with pickle, addressed to our task on our queue
        queue = farm.queue()
        with Connection(farm.env()["REDIS_URL"]) as conn:
            producer = Producer(conn, exchange=Exchange(queue), routing_key=queue)
            producer.publish(
                [[_Evil(marker)], {}, {}], serializer="pickle",
                headers={"id": "evil-1", "task": "hsfarm.extract", "lang": "py"},
                declare=[Queue(queue, Exchange(queue), routing_key=queue)])
        # When the worker receives it
        deadline = time.monotonic() + 20
        log = ""
        while time.monotonic() < deadline and "evil-1" not in log and "pickle" not in log:
            time.sleep(0.2)
            log = farm.procs["w1"].log.read_text()
        # Then it is refused as disallowed content, and never unpickled
        assert re.search(r"ContentDisallowed|Refusing to deserialize", log), log[-2000:]
        assert not marker.exists()
        assert farm.procs["w1"].alive()


def test_crafted_task_messages_are_refused_and_delete_nothing(tmp_path: Path,
                                                              tiny_model: Path) -> None:
    with running_farm(tmp_path) as farm:
        farm.start_worker("w1", concurrency=1)
        # Given a file outside the output dir that a crafted key would resolve to
        # (<out>/samples/<shard>/../../../victim.safetensors)
        victim = farm.work_dir / "victim.safetensors"
        victim.write_bytes(b"model weights, say")
        data = tmp_path / "d.jsonl"
        data.write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
        good = {"k": "a", "f": str(data), "o": 0, "n": 36, "h": "0" * 32, "i": 0}
        # When messages with a path in the key, a file that is no data file of the run, and a
        # 20 MB field arrive
        send_task(farm, {**good, "k": "../../../victim"}, "evil-key")
        send_task(farm, {**good, "f": "/etc/passwd"}, "evil-file")
        send_task(farm, {**good, "k": "x" * (20 << 20)}, "evil-big")
        r = farm.redis()

        def refused() -> list[bytes | str]:
            return [x for k in r.scan_iter(f"*:{keys.MALFORMED}") for x in r.lrange(k, 0, -1)]

        wait_until(lambda: len(refused()) == 3, 120, "three refusals")
        # Then each is refused with its reason (bounded in size), acknowledged, and nothing
        # was deleted
        assert max(len(x) for x in refused()) < 2000
        wait_until(lambda: broker_depth(r, farm.queue()) == (0, 0), 30, "the acks")
        assert victim.read_bytes() == b"model weights, say"
        log = farm.procs["w1"].log.read_text()
        assert "refusing a task message" in log and "is not a sample key" in log
        assert "is not a data file enqueued for this run" in log
        assert farm.procs["w1"].alive()
