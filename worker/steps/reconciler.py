"""The reconciler: a run heals itself when a task message is lost.

A sample is *in no state* when registered with no outcome, no message queued or unacked and
no lease: its message was lost (a worker SIGKILLed between kombu's BRPOP and its ``unacked``
write, celery#4354; a Redis that lost its last second). One main process at a time finds them
every ``FARM_RECONCILE_INTERVAL_S`` and again ``FARM_RECONCILE_CONFIRM_S`` later under
``ENQUEUE_LOCK``, marks done what is verified on disk and publishes the rest (see below).
Test: tests/farm/test_reconciler.py::test_lost_messages_are_published_again_by_the_run."""

# Why a pass never publishes a sample twice at once, one that runs, or one about to be acked:
# - the queue and ``unacked`` are read in one MULTI (``broker_keys``); kombu moves a message
#   between them atomically except at delivery (BRPOP, then the ``unacked`` write in the same
#   callback), and a message in that gap at the first read is in ``unacked`` by the second,
#   unless its consumer died: then it is lost, and healed;
# - an attempt holds the sample's lease from before it starts until its outcome is written, and
#   a verified file is marked done before the lease is released and before the ack;
# - ``enqueue`` and ``requeue`` register samples before flushing their messages, under
#   ``ENQUEUE_LOCK``; the second read and the publication hold it too.
# Left to the lease: a Redis that lost its last second may have lost the ``unacked`` entry of a
# message a worker holds, not started; published again, the two deliveries never run at once
# and the later one finds the verified file (``extract.already_done``).
# (tests/state/test_reconciler.py::test_nothing_queued_running_or_about_to_be_acked_is_republished)

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Celery

from worker.core import run as runs
from worker.core.datafile import DataFileError
from worker.core.errors import Corrupt, FarmError
from worker.core.samples import SampleRef
from worker.core.settings import Settings
from worker.core.store import OutputStore
from worker.state import broker, keys, ledger, publish
from worker.state import lease as leases
from worker.state.enqueue import EnqueueRefused, enqueue
from worker.state.index import Registered, RunIndex
from worker.state.queue_scan import broker_sample_keys_at_once
from worker.steps.base import ThreadStep, farm_of

log = logging.getLogger("hsfarm.reconciler")

# PARKED: no message on purpose while its data file cannot be read (worker/steps/parking.py); the
# janitor publishes it again once the file reads
_SETTLED = (keys.FAILED, keys.REJECTED, keys.STALE, keys.PARKED)
Sleep = Callable[[float], object]


def _settled(index: RunIndex) -> set[str]:
    """Samples with an outcome (done, failed, rejected, stale) or parked on their data file."""
    return index.done_keys() | index.settled_keys(_SETTLED)


def in_no_state(index: RunIndex, queue: str) -> dict[str, Registered]:
    """The run's samples with no outcome, no message in the broker and no lease.

    Read in the order a sample goes through them (broker, lease, outcome): a sample that
    leaves the broker while this reads was marked done before its acknowledgement, so the
    outcomes, read last, show it.
    """
    settled = _settled(index)
    candidates = {k: reg for k, reg in index.iter_registered() if k not in settled}
    if not candidates:
        return {}
    busy = broker_sample_keys_at_once(index, queue)
    names = [k for k in candidates if k not in busy]
    free = [k for k, held in zip(names, index.leased(names), strict=True) if not held]
    settled = _settled(index)
    return {k: candidates[k] for k in free if k not in settled}


@dataclass
class Pass:
    """What one pass found and did."""

    suspects: int = 0
    republished: int = 0
    relearnt: int = 0


class Reconciler:
    """Finds the run's samples in no state and publishes them again (one pass: ``run_pass``)."""

    def __init__(self, app: Celery, settings: Settings, store: OutputStore) -> None:
        self.app, self.settings, self.store = app, settings, store
        self.r = broker.client(settings, socket_timeout_s=30)
        self.run_id = store.run_id
        self.index = RunIndex(self.r, self.run_id)
        self.queue = runs.queue_for(settings, self.run_id)

    def run_pass(self, sleep: Sleep = time.sleep) -> Pass | None:
        """One pass, if no other reconciler runs one now (None: another does). ``sleep``
        waits between the two reads; a true return ends the pass (the worker stops)."""
        got = self.index.try_run_lock(keys.RECONCILE_LOCK, self.settings.lease_ttl_s)
        if not isinstance(got, leases.Lease):
            return None
        try:
            self._restore_record()
            return self._pass(sleep)
        finally:
            got.release()

    def _restore_record(self) -> None:
        """``enqueue`` again each data file whose record Redis lost (``ledger``).

        The farm's own enqueue, in this process: it relearns what is done from the final
        files' headers, registers the file's samples and publishes what is missing.
        """
        lost = ledger.not_in_redis(self.r, self.run_id, self.settings.output_dir)
        if not lost or self.index.run_lock_taken(keys.ENQUEUE_LOCK):
            return  # an enqueue running now writes its record when it is done
        for entry in lost:
            path = entry.path
            log.warning("Redis no longer holds the run's record of %s%s: enqueueing it again",
                        path, "" if entry.limit is None else
                        f" (its first {entry.limit} records)")
            try:
                summary = enqueue(self.settings, self.store.fingerprint, Path(path), self.app,
                                  limit=entry.limit)
            except (DataFileError, EnqueueRefused, FarmError, OSError) as e:
                log.error("could not re-enqueue %s: %s", path, e)
                continue
            log.warning("re-enqueued %s: %s", path, " | ".join(summary.lines()[:6]))

    def _pass(self, sleep: Sleep) -> Pass:
        first = in_no_state(self.index, self.queue)
        result = Pass(suspects=len(first))
        if not first:
            return result
        log.info("%d samples in no state; checking again in %.0fs", len(first),
                 self.settings.reconcile_confirm_s)
        if sleep(self.settings.reconcile_confirm_s):  # the worker stops
            return result
        with self.index.run_lock(keys.ENQUEUE_LOCK, self.settings.lease_ttl_s,
                                 time.monotonic() + self.settings.reconcile_interval_s) as held:
            if held is None:  # an enqueue runs: it publishes what it finds missing itself
                return result
            again = in_no_state(self.index, self.queue)
            lost = {k: reg for k, reg in first.items() if k in again and again[k] == reg}
            self._heal(lost, result)
        return result

    def _heal(self, lost: dict[str, Registered], result: Pass) -> None:
        """Mark done what the disk holds verified; publish the rest again."""
        files = {fid: path for path, fid in self.index.data_files().items()}
        to_send = []
        for key, reg in lost.items():
            if self._relearn(key, reg):
                result.relearnt += 1
            elif reg.fid in files:
                to_send.append(reg.ref(key))
        result.republished = self._publish(to_send)

    def _relearn(self, key: str, reg: Registered) -> bool:
        """A verified final file of this record: the index learns it is done."""
        if not self.store.final_path(key).exists():
            return False
        try:
            v = self.store.verify(key, reg.sha256)
        except (Corrupt, OSError) as e:  # a worker replaces or refuses it
            log.info("%s final file does not verify (%s); published again", key, e)
            return False
        self.index.mark_done(key, v.size_bytes, v.tokens)
        log.warning("%s done on disk but not in the index (Redis lost it): marked done", key)
        return True

    def _publish(self, refs: Iterable[SampleRef]) -> int:
        refs = list(refs)
        if not refs:
            return 0
        publication = self.index.next_publication()
        with self.app.producer_or_acquire() as producer:
            for ref in refs:
                publish.send(self.app, self.queue, self.run_id, publication, ref, producer)
                self.index.note_republished(ref.key)
                log.warning("%s republished: in no state (its task message was lost)", ref.key)
        return len(refs)


class ReconcilerStep(ThreadStep):
    """Runs reconciler passes on a thread of the worker main process (a pass waits
    ``FARM_RECONCILE_CONFIRM_S`` between its reads; the event loop must not)."""

    thread_name = "hsfarm-reconciler"

    def ticker(self, worker: Any) -> tuple[Callable[[], None], float] | None:
        app = farm_of(worker)
        if app.context is None:  # worker_init did not build the run: nothing is ours
            return None
        rec = Reconciler(worker.app, app.settings, app.context.store)

        def tick() -> None:
            try:
                rec.run_pass(sleep=self.stopping.wait)
            except (FarmError, OSError) as e:  # the next pass tries again
                log.warning("reconciler: %s: %s", type(e).__name__, e)
            except Exception:  # never let the thread die: a run would stop healing
                log.exception("reconciler pass failed")

        return tick, app.settings.reconcile_interval_s
