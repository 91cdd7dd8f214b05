"""The Celery task: one sample per task, acknowledged only after a verified write.

Error policy (Celery acks an exception, so every failure is handled explicitly here):
- ``BadInput`` → recorded as rejected, acknowledged, never retried;
- ``Transient`` / ``Corrupt`` / soft time limit → ``self.retry`` with exponential backoff;
- after ``FARM_MAX_ATTEMPTS`` started attempts (retries, redeliveries after crashes and hard
  time-outs all count) → recorded as failed with the last reason, acknowledged.
- anything unexpected → logged with its traceback and retried like ``Corrupt`` (bounded):
  an exception escaping to Celery would be acknowledged and the sample lost.
Low space and a down server are not attempts: the task waits, holding its one message, so
the process takes no new work until space returns or the server answers.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any

from celery import Task
from celery.exceptions import Retry, SoftTimeLimitExceeded
from celery.signals import worker_init, worker_process_init, worker_process_shutdown

from worker import extract as ex
from worker.app import TASK_NAME, app, settings
from worker.errors import BadInput, Corrupt, NoSpace, ServerUnavailable, Transient
from worker.runtime import Runtime
from worker.samples import SampleRef

log = logging.getLogger("hsfarm.task")
_runtime: Runtime | None = None


def runtime() -> Runtime:
    """This process's runtime, built on first use (after the pool forked)."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime.build(settings, server_wait_s=settings.request_timeout_s)
    return _runtime


@worker_init.connect
def _on_worker_init(**_: Any) -> None:
    # Main process, before forking: fail fast on a bad setup (foreign output dir, no
    # server) and clean what crashed runs left behind.
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    rt = Runtime.build(settings, server_wait_s=settings.request_timeout_s)
    # temp files of writers that died with a crashed run (the janitor bootstep does the dumps)
    rt.store.clean_stale_temp(max_age_s=settings.task_time_limit_s * 2)
    rt.close()


@worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    global _runtime
    _runtime = None  # never share a loop/session/socket across fork
    runtime()


@worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    if _runtime is not None:
        _runtime.close()


def _backoff_s(attempt: int) -> float:
    base = settings.retry_backoff_s * (2 ** max(attempt - 1, 0))
    return min(base, settings.retry_backoff_max_s) * random.uniform(0.8, 1.2)


def _wait_for_server(rt: Runtime, key: str) -> None:
    """Block until the server answers again (up to FARM_SERVER_WAIT_S)."""
    deadline = time.monotonic() + settings.server_wait_s
    log.warning("%s paused: server %s unreachable", key, settings.server_url)
    while time.monotonic() < deadline:
        if rt.loop.run_until_complete(rt.client.reachable()):
            log.info("%s resumed: server answers", key)
            return
        time.sleep(1.0)


def _wait_for_space(rt: Runtime, key: str) -> bool:
    """Block while space is short (up to half the time limit). True when space is back."""
    deadline = time.monotonic() + settings.task_time_limit_s / 2
    while True:
        try:
            ex.check_space(rt)
            return True
        except Transient as e:
            if time.monotonic() > deadline:
                return False
            log.warning("%s paused: %s", key, e)
            time.sleep(settings.low_space_poll_s)


@app.task(bind=True, name=TASK_NAME, max_retries=None, acks_late=True,
          reject_on_worker_lost=True)
def extract(self: Task, ref_json: dict[str, Any]) -> dict[str, Any]:
    """Extract one sample's hidden states into a verified final file."""
    try:
        ref = SampleRef.from_json(ref_json)
    except BadInput as e:  # not ours to retry: a message no producer of this farm wrote
        log.error("dropping malformed task message: %s", e)
        return {"status": "malformed"}
    rt = runtime()
    try:
        return _extract(self, rt, ref)
    except Retry:
        raise
    except Exception as e:  # before an attempt was counted: e.g. Redis away; never acked
        log.warning("%s not started: %s: %s", ref.key, type(e).__name__, e)
        raise self.retry(countdown=_backoff_s(1)) from e


def _extract(self: Task, rt: Runtime, ref: SampleRef) -> dict[str, Any]:
    done = ex.already_done(rt, ref)
    if done is not None:
        log.info("%s already done (verified from disk)", ref.key)
        return {"status": done.status, "key": ref.key}
    if not _wait_for_space(rt, ref.key):
        raise self.retry(countdown=settings.low_space_poll_s)
    attempt = rt.index.next_attempt(ref.key)
    if attempt > settings.max_attempts:
        reason = f"gave up after {settings.max_attempts} attempts (crashes or hard time-outs)"
        rt.index.mark_failed(ref.key, reason, attempt - 1)
        log.error("%s failed: %s", ref.key, reason)
        return {"status": "failed", "key": ref.key}
    rt.index.mark_running(ref.key, f"{rt.hostname}:{os.getpid()}", attempt)
    try:
        result = ex.extract(rt, ref, attempt)
    except BadInput as e:
        rt.index.mark_rejected(ref.key, str(e), f"record {ref.index}", sha=ref.sha256)
        log.warning("%s a%d rejected: %s", ref.key, attempt, e)
        return {"status": "rejected", "key": ref.key, "reason": str(e)}
    except NoSpace as e:
        # counted (a sample that can never fit must end), but wait for space before retrying
        log.warning("%s a%d out of space: %s", ref.key, attempt, e)
        rt.index.clear_running(ref.key)
        if attempt >= settings.max_attempts:
            rt.index.mark_failed(ref.key, f"NoSpace: {e}", attempt)
            return {"status": "failed", "key": ref.key, "reason": str(e)}
        _wait_for_space(rt, ref.key)
        raise self.retry(countdown=random.uniform(0, 1)) from e
    except ServerUnavailable as e:
        log.warning("%s a%d server unavailable: %s", ref.key, attempt, e)
        _wait_for_server(rt, ref.key)
        rt.index.refund_attempt(ref.key)
        raise self.retry(countdown=random.uniform(0, 1)) from e
    except Exception as e:
        if not isinstance(e, Transient | Corrupt | SoftTimeLimitExceeded):
            log.exception("%s a%d unexpected error", ref.key, attempt)
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if attempt >= settings.max_attempts:
            rt.index.mark_failed(ref.key, reason, attempt)
            log.error("%s a%d failed for good: %s", ref.key, attempt, reason)
            return {"status": "failed", "key": ref.key, "reason": reason}
        countdown = _backoff_s(attempt)
        rt.index.clear_running(ref.key)
        log.warning("%s a%d retry in %.1fs: %s", ref.key, attempt, countdown, reason)
        raise self.retry(countdown=countdown) from e
    return {"status": result.status, "key": ref.key, "tokens": result.tokens}
