"""The task's Request class: who holds each message, and each delivery's own time limits.

Built in the worker main process for every delivery: records this process as the message's
owner (``worker.state.owners``, which the reaper reads), forgets it once
the message is acknowledged or handed back, and sizes the delivery's time limits by its
record (worker/core/time_limits.py). Settings and the run come from the task's app.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.request import Request

from worker.core import time_limits
from worker.core.errors import Transient
from worker.state import owners

log = logging.getLogger("hsfarm.reaper")


class OwnedRequest(Request):
    """A task request that records, in the worker main process, who holds its message."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        self._owner_call(owners.record)
        self._size_time_limits()

    def _size_time_limits(self) -> None:
        """This delivery's time limits, from its record's size (worker/core/time_limits.py)."""
        app = self.task.app
        try:
            record_bytes = int(self.args[0]["n"])
        except (IndexError, KeyError, TypeError, ValueError):
            return  # not a sample reference: the task refuses it under the app's limits
        if app.context is None or record_bytes < 1:
            return
        limits = time_limits.for_record(app.settings, record_bytes,
                                        app.context.limits.bytes_per_token)
        self.time_limits = limits.as_celery()
        self._request_dict["timelimit"] = limits.as_celery()  # the task's self.request sees it

    def acknowledge(self) -> None:
        super().acknowledge()
        self._owner_call(owners.forget_if_settled)

    def reject(self, requeue: bool = False) -> None:
        super().reject(requeue=requeue)
        self._owner_call(owners.forget_if_settled)

    def _owner_call(self, fn: Any) -> None:
        tag = getattr(self.message, "delivery_tag", None)
        if tag is None:
            return
        try:
            fn(owners.client_for(self.task.app.settings), tag)
        except Transient as e:  # the visibility timeout still covers this message
            log.warning("cannot record the owner of message %s: %s", tag, e)
