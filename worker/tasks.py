"""The Celery task: one sample per task, acknowledged only once the sample has an outcome.

An outcome (done, rejected, failed, stale, parked, removed, refused) is recorded in the run
index before the ack; every other way out hands the message back (``Reject(requeue=True)``). A
counted attempt (``Transient``, ``Corrupt``, anything unexpected) retries with backoff while
the time limit allows; the environment's faults make the task wait holding its message, its
attempt refunded; ``ConfigError`` stops the worker. Each attempt holds the sample's lease.
Test: tests/farm/test_faults.py::test_hung_server_spends_no_attempts."""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Reject, SoftTimeLimitExceeded

from worker import extract as ex
from worker import waits
from worker.app import FarmApp, app
from worker.core import setaside
from worker.core.errors import (
    BadInput,
    ConfigError,
    Corrupt,
    DataFileUnavailable,
    KeyTaken,
    MalformedMessage,
    NoSpace,
    OutOfTime,
    OutputUnavailable,
    RecordRemoved,
    ServerBusy,
    ServerMisconfigured,
    ServerUnavailable,
    StaleRecord,
    Transient,
)
from worker.core.run import TASK_NAME, run_of_task
from worker.core.samples import SampleRef
from worker.core.settings import Settings
from worker.runtime import Runtime
from worker.startup import runtime, stop_worker
from worker.state import lease as leases
from worker.state.corpus import Corpus
from worker.state.publish import send_message
from worker.state.queue_scan import sharing_warning

log = logging.getLogger("hsfarm.task")
# What an attempt may end with, short of an outcome: logged without a traceback.
EXPECTED_FAILURES = (Transient, Corrupt, SoftTimeLimitExceeded)


class SampleNotDone(Exception):
    """A recorded outcome other than done: the task ends in FAILURE, its message is acked."""


class SampleRejected(SampleNotDone):
    pass


class SampleFailed(SampleNotDone):
    pass


class SampleStale(SampleNotDone):
    pass


class MessageRefused(SampleNotDone):
    pass


class SampleParked(SampleNotDone):
    pass


class SampleRemoved(SampleNotDone):
    pass


def _backoff_s(s: Settings, attempt: int) -> float:
    base = s.retry_backoff_s * (2 ** max(attempt - 1, 0))
    return min(base, s.retry_backoff_max_s) * random.uniform(0.8, 1.2)


def _budget_s(farm: FarmApp, request: Any) -> float:
    """How long this delivery may work: until shortly before its soft time limit (sized by
    its sample, worker/core/time_limits.py), else the app's."""
    limits = getattr(request, "timelimit", None)
    soft_s = limits[1] if isinstance(limits, (list, tuple)) and len(limits) == 2 else None
    return float(soft_s or farm.conf.task_soft_time_limit or farm.settings.task_time_limit_s) - 2.0


@app.task(bind=True, name=TASK_NAME, max_retries=None, acks_late=True,
          reject_on_worker_lost=True, throws=(SampleNotDone,),
          Request="worker.request:OwnedRequest")
def extract(self: Task, ref_json: Any) -> dict[str, Any]:
    """Extract one sample's hidden states into a verified final file."""
    budget_s = _budget_s(self.app, self.request)
    deadline = time.monotonic() + budget_s
    try:
        rt = runtime(self.app)
        foreign = _hand_back_foreign(self.app, rt, self.request.id, ref_json)
        if foreign is not None:
            return foreign
        return _run(rt, ref_json, deadline, budget_s)
    except (SampleNotDone, Reject):
        raise
    except ConfigError as e:
        stop_worker(str(e))
        raise Reject(str(e), requeue=True) from e
    except BaseException as e:  # the soft time limit, Redis away mid-bookkeeping, anything
        log.warning("handing the message back: %s: %s", type(e).__name__, e)
        raise Reject(f"{type(e).__name__}: {e}", requeue=True) from e


def _hand_back_foreign(farm: FarmApp, rt: Runtime, task_id: object,
                       ref_json: Any) -> dict[str, Any] | None:
    """Hands a message of another run back untouched, for its own workers; None for ours.

    The copy goes to the far end of the queue, then this delivery is acked: a crash in between
    leaves two messages (the lease and done check make that harmless), never none. A requeue
    (``Reject``) would put it next in line, where this worker, the only idle consumer, takes it
    again. The random pause after the copy keeps a worker left with another run's messages from
    spinning, and makes the other run's processes as likely as ours to take the copy first.
    """
    other = run_of_task(task_id)
    if other is None or other == rt.run_id:
        return None
    log.warning("handing back untouched a message of run %s: %s", other,
                sharing_warning(rt.queue, rt.run_id, [other]))
    key = ref_json.get("k") if isinstance(ref_json, dict) else None
    send_message(farm, rt.queue, str(task_id), ref_json, str(key))
    time.sleep(min(1.0, rt.settings.pause_poll_s) * random.uniform(0.2, 1.8))
    return {"status": "handed back", "run": other}


def _run(rt: Runtime, ref_json: Any, deadline: float, budget_s: float) -> dict[str, Any]:
    ref = _checked_ref(rt, ref_json)
    with rt.index.sample_lease(ref.key, rt.settings.lease_ttl_s, deadline) as lease:
        if lease is None:
            raise Reject(f"{ref.key}: another attempt still holds it", requeue=True)
        return _attempts(rt, ref, lease, deadline, budget_s)


def _checked_ref(rt: Runtime, ref_json: Any) -> SampleRef:
    """The message's sample reference, every field checked against this run.

    Raises:
        MessageRefused: recorded (bounded) and logged; the message is acknowledged.
    """
    try:
        sent = SampleRef.from_json(ref_json)
        if sent.length > rt.settings.max_record_bytes:
            raise MalformedMessage(f"n: {sent.length} bytes is over FARM_MAX_RECORD_BYTES")
        ref = Corpus(rt.index).resolve(sent)
    except MalformedMessage as e:
        log.error("refusing a task message: %s", e)
        rt.index.record_malformed(str(e))
        raise MessageRefused(str(e)) from e
    except RecordRemoved as e:
        log.warning("%s", e)
        raise SampleRemoved(str(e)) from e
    if ref.sha256 != sent.sha256:
        log.info("%s the run records a corrected record (content %s, the message's %s): "
                 "extracting the run's", ref.key, ref.sha256, sent.sha256)
    return ref


def _attempts(rt: Runtime, ref: SampleRef, lease: leases.Lease, deadline: float,
              budget_s: float) -> dict[str, Any]:
    """Attempts of one sample under its lease, until it has an outcome or must be handed back."""
    key = ref.key
    while True:
        try:
            done = ex.already_done(rt, ref)
        except KeyTaken as e:
            _give_up(rt, key, str(e), attempts=0)
        if done is not None:
            log.info("%s already done (verified from disk)", key)
            return {"status": done.status, "key": key}
        elsewhere = ex.done_elsewhere(rt, ref)
        if elsewhere is not None:
            log.info("%s already done on host %s (its output dir holds it)", key, elsewhere)
            return {"status": "done-elsewhere", "key": key}
        # no verified file here or elsewhere: if the index still says done (a file damaged or
        # deleted after), it must not, or this attempt's outcomes would be dropped as late
        rt.index.unmark_done([key])
        _wait(rt, key, lambda: waits.dump_dir_problem(rt) or waits.space_problem(rt), deadline)
        _wait(rt, key, lambda: rt.canary.problem(rt.client, rt.loop, rt.index, deadline),
              deadline)
        _enough_time_left(key, deadline, budget_s)
        attempt = rt.index.next_attempt(key)
        if attempt > rt.settings.max_attempts:
            _give_up(rt, key, f"gave up after {rt.settings.max_attempts} attempts (crashes or "
                              "time-outs)", attempt - 1)
        rt.index.mark_running(key, f"{rt.hostname}:{os.getpid()}", attempt)
        t0 = time.monotonic()
        try:
            result = ex.extract(rt, ref, attempt, lease, rt.index.next_try(key), deadline,
                                budget_s)
            _set_aside_if_removed(rt, key)
            return {"status": result.status, "key": key, "tokens": result.tokens}
        except BadInput as e:
            rt.index.mark_rejected(key, str(e), f"record {ref.index}", sha=ref.sha256)
            log.warning("%s a%d rejected: %s", key, attempt, e)
            raise SampleRejected(str(e)) from e
        except OutOfTime as e:  # a regenerated turn needs a whole delivery: kept turns stay
            rt.index.refund_attempt(key)
            rt.index.clear_running(key)
            log.info("%s a%d %s", key, attempt, e)
            raise Reject(str(e), requeue=True) from e
        except StaleRecord as e:
            rt.index.refund_attempt(key)
            rt.index.mark_stale(key, str(e))
            log.warning("%s a%d stale: %s", key, attempt, e)
            raise SampleStale(str(e)) from e
        except ConfigError:  # the environment broke under the process: hand back and stop
            rt.index.refund_attempt(key)
            rt.index.clear_running(key)
            raise
        except DataFileUnavailable as e:
            rt.index.refund_attempt(key)
            _park(rt, ref, e)
        except (ServerUnavailable, NoSpace, OutputUnavailable, leases.LeaseLost) as e:
            rt.index.refund_attempt(key)
            rt.index.clear_running(key)
            _environment(rt, ref, e, deadline)
        except Exception as e:  # Transient, Corrupt, unexpected: a counted attempt
            _failed_attempt(rt, key, attempt, e, time.monotonic() - t0, deadline)


def _environment(rt: Runtime, ref: SampleRef, e: Exception, deadline: float) -> None:
    """Wait out the environment's fault (holding the message), or hand the message back."""
    log.warning("%s paused (no attempt spent): %s: %s", ref.key, type(e).__name__, e)
    if isinstance(e, leases.LeaseLost):
        raise Reject(str(e), requeue=True)
    if isinstance(e, ServerMisconfigured):  # it answers at once: hold a while, then try again
        _hold(rt, ref.key, str(e), deadline)
    elif isinstance(e, ServerBusy):  # a refusal for now, maybe of /generate alone: hold
        if e.status >= 500:  # the server behind a gateway may be restarting: check its model
            rt.canary.force()
        _hold(rt, ref.key, str(e), deadline)
    elif isinstance(e, ServerUnavailable):
        rt.canary.force()  # the server may come back with another model: check before work
        _wait(rt, ref.key, lambda: waits.server_problem(rt), deadline)
    elif isinstance(e, NoSpace):
        never = str(e) if e.never_fits else waits.never_fits(rt, e.need_bytes)
        if never:
            _give_up(rt, ref.key, f"NoSpace: {never}", rt.index.next_attempt(ref.key))
        if e.on_server:
            _hold(rt, ref.key, str(e), deadline)
        _wait(rt, ref.key, lambda: waits.space_problem(rt, e.need_bytes), deadline)
    else:
        _wait(rt, ref.key, lambda: waits.output_problem(rt), deadline)


def _park(rt: Runtime, ref: SampleRef, e: DataFileUnavailable) -> NoReturn:
    """The data file cannot be read here: the sample waits without its message (no process
    held, no other file's samples behind it) until the file is readable or re-enqueued."""
    Corpus(rt.index).park(ref, str(e), rt.hostname)
    log.warning("%s parked (no attempt spent): %s", ref.key, e)
    raise SampleParked(str(e))


def _set_aside_if_removed(rt: Runtime, key: str) -> None:
    """An ``enqueue`` took the sample out of the run while it ran: its new file goes aside
    too, as enqueue did with the files it found."""
    if rt.index.registered([key])[0] is None:
        setaside.set_aside(rt.settings.output_dir, key)
        rt.index.unregister([key], reason="its record left the corpus while it ran")
        log.warning("%s left the run while it ran; its file is set aside", key)


def _enough_time_left(key: str, deadline: float, budget_s: float) -> None:
    """An attempt starts only with half a delivery's time or more left: the time limit must
    never cut an attempt short because a pause (the environment) used its time, which would
    count against the sample; else the message goes back for a fresh delivery."""
    left_s = deadline - time.monotonic()
    if left_s < budget_s / 2:
        raise Reject(f"{key}: {left_s:.0f}s of this delivery left, under half of it; handed "
                     "back for a whole one (no attempt spent)", requeue=True)


def _hold(rt: Runtime, key: str, reason: str, deadline: float) -> None:
    """Wait one poll interval for a fault this worker cannot observe clearing."""
    until = time.monotonic() + rt.settings.pause_poll_s
    _wait(rt, key, lambda: reason if time.monotonic() < until else None, deadline)


def _wait(rt: Runtime, key: str, problem: Any, deadline: float) -> None:
    if not waits.until_clear(rt, key, problem, deadline, rt.settings.pause_poll_s):
        raise Reject(f"{key}: still paused at the time limit", requeue=True)


def _failed_attempt(rt: Runtime, key: str, attempt: int, e: Exception, took_s: float,
                    deadline: float) -> None:
    """Record a counted failure; return to retry in this delivery, or raise to end it."""
    if not isinstance(e, EXPECTED_FAILURES):
        log.exception("%s a%d unexpected error", key, attempt)
    reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if attempt >= rt.settings.max_attempts:
        _give_up(rt, key, reason, attempt)
    backoff_s = _backoff_s(rt.settings, attempt)
    rt.index.mark_retrying(key, attempt, reason)
    if time.monotonic() + backoff_s + took_s > deadline:
        log.warning("%s a%d failed, handed back for a later attempt: %s", key, attempt, reason)
        raise Reject(reason, requeue=True) from e
    log.warning("%s a%d failed, retry in %.1fs: %s", key, attempt, backoff_s, reason)
    time.sleep(backoff_s)


def _give_up(rt: Runtime, key: str, reason: str, attempts: int) -> NoReturn:
    rt.index.mark_failed(key, reason, attempts)
    log.error("%s failed for good: %s", key, reason)
    raise SampleFailed(reason)
