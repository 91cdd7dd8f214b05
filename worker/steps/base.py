"""What every step of ours shares: the app it is given, and its start/stop around one tick.

A step reads ``worker.app`` (a ``FarmApp``: ``.settings``, and ``.context`` once
worker/startup.py built the run) and never imports the app's modules. ``TimerStep`` ticks on
the worker's timer, ``ThreadStep`` on a thread of its own (a tick that may block).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from celery import bootsteps

from engine_dump.fingerprint import Fingerprint
from worker.core.settings import Settings
from worker.core.store import OutputStore

Tick = Callable[[], object]


class Run(Protocol):
    """The run's context as a step reads it (worker/runtime.py's ``RunContext``)."""

    @property
    def store(self) -> OutputStore: ...

    @property
    def fingerprint(self) -> Fingerprint: ...


class Farm(Protocol):
    """The app a step is given (worker/app.py's ``FarmApp``)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def context(self) -> Run | None: ...


def farm_of(worker: Any) -> Farm:
    """The app Celery gives a step, read as ours."""
    app: Farm = worker.app
    return app


class TickStep(bootsteps.StartStopStep):
    """A step that runs one tick, over and over; ``ticker`` says what and how often."""

    def ticker(self, worker: Any) -> tuple[Tick, float] | None:
        """What to run and how often (seconds); None: nothing to do in this worker."""
        raise NotImplementedError

    def start(self, worker: Any) -> None:
        got = self.ticker(worker)
        if got is not None:
            self.begin(worker, *got)

    def begin(self, worker: Any, tick: Tick, every_s: float) -> None:
        raise NotImplementedError


class TimerStep(TickStep):
    """Ticks once at start, then every ``every_s`` on the worker main process's timer."""

    requires = ("celery.worker.components:Timer",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None

    def begin(self, worker: Any, tick: Tick, every_s: float) -> None:
        tick()
        self.tref = worker.timer.call_repeatedly(every_s, tick, priority=10)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()


class ThreadStep(TickStep):
    """Ticks every ``every_s`` (none at start) on a daemon thread of the worker main process."""

    thread_name = "hsfarm-step"
    join_s: float | None = 5.0  # how long ``stop`` waits for the thread; None: not at all

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def begin(self, worker: Any, tick: Tick, every_s: float) -> None:
        self.thread = threading.Thread(target=self._loop, args=(tick, every_s), daemon=True,
                                       name=self.thread_name)
        self.thread.start()

    def _loop(self, tick: Tick, every_s: float) -> None:
        while not self.stopping.wait(every_s):
            tick()

    def stop(self, worker: Any) -> None:
        self.stopping.set()
        if self.thread is not None and self.join_s is not None:
            self.thread.join(timeout=self.join_s)
