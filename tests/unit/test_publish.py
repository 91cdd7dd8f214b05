"""A sample's task message has one shape, whoever publishes it (worker/state/publish.py): the
task name, the reference as the one argument, a task id naming run and publication, the
sample key as ``argsrepr``. Messages already queued by older workers must still match it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from worker.core.errors import Transient
from worker.core.samples import SampleRef
from worker.state import publish

# what publishing reads of a producer besides sending through it: its connection's errors
PRODUCER = SimpleNamespace(connection=SimpleNamespace(connection_errors=(), channel_errors=()))


class Recorder:
    """An app that records what it is asked to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.sent.append((name, kwargs))

    @contextmanager
    def producer_or_acquire(self, producer: Any = None) -> Iterator[Any]:
        yield producer or PRODUCER


def test_every_message_of_a_sample_has_the_same_shape() -> None:
    # Given two samples of run 0123456789abcdef
    refs = [SampleRef(key=f"ex-{i}", file="", offset=10 * i, length=10, sha256="ab" * 32,
                      index=i, fid=1) for i in range(2)]
    app = Recorder()
    # When both are published in publication 7, then one is handed back as it came
    assert publish.send_all(app, "hsfarm.q", "0123456789abcdef", 7, refs) == 2
    publish.send_message(app, "hsfarm.q", "hsd-x-1:ex-0", {"k": "ex-0"}, "ex-0")
    # Then each names the task, its reference, its run and publication, and the sample key
    assert app.sent[0] == ("hsfarm.extract", {
        "args": [refs[0].to_json()], "task_id": "hsd-0123456789abcdef-7:ex-0",
        "queue": "hsfarm.q", "producer": PRODUCER, "argsrepr": "ex-0", "kwargsrepr": "{}"})
    assert app.sent[1][1]["task_id"] == "hsd-0123456789abcdef-7:ex-1"
    assert app.sent[2] == ("hsfarm.extract", {
        "args": [{"k": "ex-0"}], "task_id": "hsd-x-1:ex-0", "queue": "hsfarm.q",
        "producer": PRODUCER, "argsrepr": "ex-0", "kwargsrepr": "{}"})


def test_a_broker_that_does_not_answer_is_transient() -> None:
    # Given a real Celery app whose broker is a port nothing listens on
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = Celery(broker=f"redis://127.0.0.1:{port}/0", set_as_current=False)
    ref = SampleRef(key="ex-0", file="", offset=0, length=1, sha256="ab" * 32, index=0, fid=1)
    # When a sample is published, alone or among others, Then kombu's error is the farm's
    # Transient (the caller pauses or says Redis is down), never a redis-py class
    with pytest.raises(Transient, match="broker: OperationalError"):
        publish.send(app, "hsfarm.q", "0123456789abcdef", 1, ref)
    with pytest.raises(Transient, match="broker: OperationalError"):
        publish.send_all(app, "hsfarm.q", "0123456789abcdef", 1, [ref])
