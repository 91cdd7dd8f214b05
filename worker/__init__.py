"""hsfarm worker: the Celery app and its one task.

``celery -A worker worker`` finds ``app`` here.
"""

from worker.app import app

__all__ = ["app"]
