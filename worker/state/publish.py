"""Publishing a sample: the one shape of its task message, whoever sends it (``enqueue``,
parked samples, the reconciler, a worker handing back another run's message).

``hsfarm.extract`` with the sample reference as its one argument; the task id names the run
and the publication (worker/core/run.py), so a worker of another run hands it back untouched;
``argsrepr`` is the sample key: Flower shows it, and the default (the repr of the args) would
cost ~150 bytes of Redis per queued message. The app is given (this layer imports no Celery).
Tests: tests/farm/test_enqueue.py, tests/state/test_reconciler.py."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from kombu.exceptions import OperationalError

from worker.core import run as runs
from worker.core.errors import Transient
from worker.core.run import TASK_NAME
from worker.core.samples import SampleRef


class App(Protocol):
    """What publishing needs of the Celery app."""

    def send_task(self, name: str, *args: Any, **kwargs: Any) -> Any: ...

    def producer_or_acquire(self, producer: Any = None) -> Any: ...


@contextmanager
def _producer(app: App, producer: Any = None) -> Iterator[Any]:
    """``producer``, or one of the app's pool; a broker that does not answer raises
    ``Transient`` (kombu's errors: its own client, not the farm's)."""
    with app.producer_or_acquire(producer) as p:
        conn = p.connection
        try:
            yield p
        except (OperationalError, *conn.connection_errors, *conn.channel_errors) as e:
            raise Transient(f"broker: {type(e).__name__}: {e}") from e


def send_message(app: App, queue: str, task_id: str, ref_json: Any, key: str,
                 producer: Any = None) -> None:
    """One task message of a sample whose reference is ``ref_json`` (as sent: a message
    handed back goes out as it came in).

    Raises:
        Transient: the broker does not answer.
    """
    with _producer(app, producer) as p:
        app.send_task(TASK_NAME, args=[ref_json], task_id=task_id, queue=queue, producer=p,
                      argsrepr=key, kwargsrepr="{}")


def send(app: App, queue: str, run_id: str, publication: int, ref: SampleRef,
         producer: Any = None) -> None:
    """The task message of ``ref`` in publication ``publication`` of run ``run_id``."""
    send_message(app, queue, runs.task_id(run_id, publication, ref.key), ref.to_json(),
                 ref.key, producer)


def send_all(app: App, queue: str, run_id: str, publication: int,
             refs: Iterable[SampleRef]) -> int:
    """One task message per sample of ``refs``, on one producer. Returns how many."""
    sent = 0
    with _producer(app) as producer:
        for ref in refs:
            send(app, queue, run_id, publication, ref, producer)
            sent += 1
    return sent
