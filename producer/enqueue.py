"""``python -m producer enqueue`` and ``audit --requeue``: the app and the progress bar around
``worker.state.enqueue``, where a run's samples are registered and published (the worker's
reconciler calls the same functions in-process)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from engine_dump.fingerprint import Fingerprint
from worker.app import create_app
from worker.core.samples import SampleRef
from worker.core.settings import Settings
from worker.core.store import OutputStore
from worker.state import enqueue as state


@contextlib.contextmanager
def bar_meter(desc: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr of the bytes of the data file a pass read."""
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr) as bar:
        yield lambda at: bar.update(at - bar.n)


def enqueue(settings: Settings, fingerprint: Fingerprint, path: Path, *, progress: bool = True,
            **kw: Any) -> state.Summary:
    """``worker.state.enqueue.enqueue`` with this process's Celery app; a progress bar unless
    ``progress`` is false. Raises what it raises."""
    with create_app(settings) as app:
        return state.enqueue(settings, fingerprint, path, app,
                             meter=bar_meter if progress else state.no_meter, **kw)


def requeue(settings: Settings, store: OutputStore, refs: list[SampleRef]) -> int:
    """``worker.state.enqueue.requeue`` with this process's Celery app."""
    with create_app(settings) as app:
        return state.requeue(settings, store, refs, app)
