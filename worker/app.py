"""The Celery app, configured so that no message is lost: acknowledged late, rejected when its
worker is lost, one prefetched, JSON only, a hard time limit under Redis' visibility timeout.
Only the app lives here.

``create_app(settings)`` builds a ``FarmApp``: its bootsteps read ``.settings`` and the run's
``.context`` (set by worker/startup.py) from the app they are given. ``app``, the worker's
own, is built from the environment on first use (``celery -A worker worker`` finds it through
``worker/__init__.py``), so importing this module reads no environment.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import orjson
from celery import Celery
from kombu.serialization import register

from worker.core.errors import ConfigError
from worker.core.settings import Settings
from worker.core.time_limits import soft_for
from worker.state.broker import tls_options, use_transport
from worker.steps import STEPS

if TYPE_CHECKING:
    from worker.runtime import RunContext

SERIALIZER = "orjson"

# orjson under its own content type (never application/json, which would replace kombu's
# json decoder globally). JSON only: pickle is never accepted anywhere.
register(SERIALIZER, orjson.dumps, orjson.loads,
         content_type="application/x-orjson", content_encoding="utf-8")


def celery_config(s: Settings) -> dict[str, object]:
    """The whole Celery configuration, derived from the settings."""
    tls = tls_options(s)
    return {
        "broker_url": s.redis_url,
        **({"broker_use_ssl": tls} if tls else {}),
        "task_serializer": SERIALIZER,
        "accept_content": [SERIALIZER, "json"],
        "result_serializer": "json",
        "result_accept_content": ["json"],
        "task_ignore_result": True,  # the output disk is the source of truth
        # Only Celery's name for a queue nobody named: every process that publishes or
        # consumes uses the run's queue (worker/core/run.py; a worker selects it at start-up)
        "task_default_queue": s.queue or "hsfarm",
        "task_acks_late": True,  # acknowledge only after the verified write
        "task_reject_on_worker_lost": True,  # a killed pool process → message requeued
        # Only recorded outcomes end in FAILURE (tasks.py); anything else hands the message
        # back with Reject(requeue=True), so acknowledging failures loses nothing.
        "task_acks_on_failure": True,
        "task_acks_on_timeout": False,  # a hard timeout requeues; attempts are bounded
        # A sample too short to add to the limits; each message gets its own by its size
        # (worker/core/time_limits.py, set in worker/request.py's OwnedRequest)
        "task_soft_time_limit": soft_for(s.task_time_limit_s),
        "task_time_limit": s.task_time_limit_s,
        "worker_prefetch_multiplier": 1,  # each process holds one message at most
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_soft_shutdown_timeout": s.soft_shutdown_s,
        "worker_enable_soft_shutdown_on_idle": True,
        "worker_send_task_events": True,  # for Flower
        "task_send_sent_event": True,
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        # a Redis away for longer than Celery's 100 tries (~45 min at kombu's 30 s interval
        # cap) is still the environment's fault: the worker keeps waiting, paused, not exits
        "broker_connection_max_retries": None,
        "broker_transport_options": {
            # The only copy of visibility_timeout that kombu reads; same in every process.
            "visibility_timeout": s.visibility_timeout_s,
            "unacked_restore_interval": s.restore_interval_s,
            "unacked_restore_throttle": 1,
            "socket_timeout": 30,
            "socket_connect_timeout": 5,
        },
    }


class FarmApp(Celery):
    """The farm's Celery app: its settings, and the run's context once a worker built it."""

    def __init__(self, settings: Settings, main: str = "hsfarm", **kwargs: Any) -> None:
        super().__init__(main, **kwargs)
        use_transport()  # kombu's Redis transport, closing a lost connection's channels safely
        self.settings = settings
        self.context: RunContext | None = None  # built in worker_init; inherited by the pool
        self.conf.update(celery_config(settings))
        self.conf.imports = ("worker.tasks",)
        self.steps["worker"].update(STEPS)

    def __reduce_keys__(self) -> dict[str, Any]:
        """Celery's, with the settings: an app pickled to another process keeps them."""
        return {**super().__reduce_keys__(), "settings": self.settings}


def create_app(settings: Settings) -> FarmApp:
    """The farm's app for these settings (a worker's, or a producer's to publish with)."""
    return FarmApp(settings, set_as_current=True)


def __getattr__(name: str) -> FarmApp:
    """``app``: the worker's app, from the environment (exit 2 with the fix when unreadable)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        settings = Settings.from_env()
    except ConfigError as e:  # `celery -A worker` and the scripts that use it stop here
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    built = globals()["app"] = create_app(settings)
    return built
