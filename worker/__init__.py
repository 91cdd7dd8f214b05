"""hsfarm's library and its Celery worker, in layers; each imports only those above it here.

``core`` (formats, the output store, settings) · ``state`` (the run in Redis) · ``server``
(the served model seen from a worker) · ``steps`` (lifecycle bootsteps) · then ``app``,
``startup``, ``tasks``. tests/unit/test_layers.py enforces the order. ``celery -A worker`` finds
``app`` here, imported lazily so ``worker.core`` needs no Celery (training/ reads files only).
"""

from __future__ import annotations

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    """``worker.app``: the Celery app, imported on first use."""
    if name == "app":
        from worker.app import app as celery_app  # on use: training imports worker.core alone

        # importing the submodule bound ``worker.app`` to the module; bind the app instead,
        # as the eager ``from worker.app import app`` did
        globals()["app"] = celery_app
        return celery_app
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
