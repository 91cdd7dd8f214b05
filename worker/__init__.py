"""hsfarm worker: the Celery app and its one task.

``celery -A worker worker`` finds ``app`` here (Celery's ``find_app`` reads ``worker.app``).
The app is imported lazily, on first access of ``worker.app``, so that the file-format code
(``worker.tensorfile``, ``worker.store``) imports without Celery, Redis or the settings: the
training side (``training/``) runs on machines that have none of them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    """``worker.app``: the Celery app, imported on first use."""
    if name == "app":
        from worker.app import app as celery_app

        # importing the submodule bound ``worker.app`` to the module; bind the app instead,
        # as the eager ``from worker.app import app`` did
        globals()["app"] = celery_app
        return celery_app
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
