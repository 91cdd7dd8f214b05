"""Publish one idempotent task per sample of a data file: ``enqueue`` and ``requeue``, the one
way in for ``python -m producer enqueue``, adopt and the worker's reconciler. **check**
refuses the whole file before anything is published when a key clashes with the run's other
data files; **publish** registers and publishes each sample unless its task is in flight, the
run rejected it, or it is done: marked so with its file there, or a file that verifies by its
header (read whole if an attempt doubted it), relearnt when Redis lost it. The run's enqueue
lock makes re-runs and two at once safe; a moved file is found by its content (docs/input.md).
Tests: tests/farm/test_enqueue.py, tests/farm/test_corpus.py, tests/farm/test_reconciler.py."""

# The caller brings the Celery app (``publish.send`` needs only its producer pool) and, if it
# shows progress, a ``Meter``: this layer holds no Celery and draws nothing.

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis

from engine_dump.dumpfile import PATCH_VERSION, T_INPUT_IDS
from engine_dump.fingerprint import Fingerprint
from engine_dump.rids import NO_RUN
from worker.core import finalfile, outdir, setaside, tensorfile
from worker.core import run as runs
from worker.core import store as st
from worker.core.datafile import DataFileError, file_sha256
from worker.core.errors import Corrupt, environmental_rejection
from worker.core.samples import SampleRef, key_digest, sample_refs
from worker.core.settings import Settings
from worker.state import broker, hosts, keys, ledger, publish, queue_scan
from worker.state import lease as leases
from worker.state.corpus import Corpus, Identified
from worker.state.index import Registered, RunIndex
from worker.state.queue_scan import broker_sample_keys

# A progress display: given a pass's name ("check", "enqueue") and the file's size in bytes, a
# context whose value is told each byte offset the pass reaches
Meter = Callable[[str, int], AbstractContextManager[Callable[[int], None]]]


@contextlib.contextmanager
def no_meter(desc: str, total: int) -> Iterator[Callable[[int], None]]:
    """The ``Meter`` that shows nothing."""
    yield lambda at: None


BATCH = 1000  # records per Redis round trip
HEADER_THREADS = 8  # final-file headers read at once
SHOW = 5  # conflicts named in the refusal


class EnqueueRefused(Exception):
    """The file cannot join this run as it is; nothing was published."""


@dataclass
class Summary:
    records: int = 0
    published: int = 0
    already_done: int = 0
    done_elsewhere: int = 0  # of already_done: held by another host's output dir
    already_queued: int = 0
    previously_rejected: int = 0
    previously_failed: int = 0
    removed: int = 0  # samples whose records left the file: out of the run
    superseded: int = 0  # records with ids corrected after their file was written
    redone: int = 0  # marked done, but their final file is gone or not as verified
    set_aside: int = 0  # output files moved to <out>/removed/ (or deleted)
    moved_from: str | None = None  # the path this data file was recorded at before
    fid: int = 0
    decide_s: float = 0.0  # reading the file and the run's state: what to publish
    publish_s: float = 0.0
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (where, reason)
    problems: list[tuple[str, str]] = field(default_factory=list)  # file-level, not records
    notes: list[tuple[str, str]] = field(default_factory=list)  # accepted, but worth knowing

    def lines(self) -> list[str]:
        out = [
            f"records: {self.records}",
            f"published: {self.published}",
            f"already done: {self.already_done}"
            + (f" ({self.done_elsewhere} on other hosts)" if self.done_elsewhere else ""),
            f"already queued or running: {self.already_queued}",
            f"rejected: {len(self.rejected)}",
        ]
        if self.previously_rejected or self.previously_failed:
            out.append(f"skipped, rejected/failed earlier in this run: "
                       f"{self.previously_rejected}/{self.previously_failed} "
                       "(see 'status --failures'; --retry-failed retries the failed)")
        if self.moved_from:
            out.append(f"moved: data file #{self.fid} was {self.moved_from}; its queued and "
                       "parked samples read from here now")
        if self.removed:
            out.append(f"removed from the corpus: {self.removed} samples no longer in the "
                       "file left the run")
        if self.superseded:
            out.append(f"superseded: {self.superseded} records corrected since their file "
                       "was written; extracted again")
        if self.redone:
            out.append(f"redone: {self.redone} samples marked done whose final file is gone "
                       "or not the size it was verified at are not done; published again "
                       "unless queued or running")
        if self.set_aside:
            out.append(f"set aside: {self.set_aside} output files of removed or superseded "
                       f"records (in {outdir.REMOVED_DIR}/ of the output dir)")
        out.append(f"decided in {self.decide_s:.1f}s, published in {self.publish_s:.1f}s")
        out += [f"  {where}: {reason}" for where, reason in self.problems + self.rejected]
        out += [f"  note, {where}: {text}" for where, text in self.notes]
        return out

    @property
    def ok(self) -> bool:
        return not (self.rejected or self.problems)


def _batches(refs: Iterator[SampleRef]) -> Iterator[list[SampleRef]]:
    batch: list[SampleRef] = []
    for ref in refs:
        batch.append(ref)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass
class _Plan:
    """What pass 1 learnt: 64-bit digests of keys, the only per-record state kept."""

    fid: int
    version: tuple[int, int]  # (size, mtime_ns) of the file when checked
    done: set[int] = field(default_factory=set)  # keys whose final file is this record's
    keys_seen: set[int] = field(default_factory=set)
    conflicts: list[str] = field(default_factory=list)
    n_conflicts: int = 0
    done_elsewhere: set[int] = field(default_factory=set)  # held by another host's dir
    # done on disk but not in the index (Redis lost it): key -> (file bytes, tokens)
    relearn: dict[str, tuple[int, int]] = field(default_factory=dict)
    relearn_at: dict[str, float] = field(default_factory=dict)  # key -> its file's mtime
    relearn_sha: dict[str, str] = field(default_factory=dict)  # key -> its content hash
    # done in the index, but their final file here is gone or not the size it was verified
    # at: taken out of done and published again
    redo: set[str] = field(default_factory=set)
    own_paths: set[str] = field(default_factory=set)  # every path this data file had
    superseded: set[str] = field(default_factory=set)  # keys whose file is an older version


def _file_version(path: Path) -> tuple[int, int]:
    try:
        s = path.stat()
    except OSError as e:
        raise DataFileError(f"{path}: {e.strerror}") from e
    return s.st_size, s.st_mtime_ns


def _existing(store: st.OutputStore, key: str) -> tensorfile.Header | None:
    try:
        return tensorfile.read_header(store.final_path(key))
    except (OSError, Corrupt):
        return None


def _check(index: RunIndex, store: st.OutputStore, path: Path, fid: int,
           refs: Iterator[SampleRef], own_paths: set[str], host: str) -> _Plan:
    """Pass 1: find the keys this file cannot take; note which samples are done on disk.

    A sample the index already knows as done, registered from this very record, needs one
    ``stat`` (its file is there, at the size it was verified at); every other key's final
    file, if any, has its header read (in parallel: on a cold disk the reads wait on I/O),
    and its tensor data only when the index doubts it (``RunIndex.in_question``).
    """
    plan = _Plan(fid, _file_version(path), own_paths=own_paths)
    done_in_index = index.done_keys()
    with ThreadPoolExecutor(max_workers=HEADER_THREADS) as pool:
        for batch in _batches(refs):
            names = [r.key for r in batch]
            regs, held = index.registered(names), hosts.holders(index.r, index.run_id, names)
            away = [ref.key in done_in_index and by is not None and by[0] != host
                    and by[1] == ref.sha256 for ref, by in zip(batch, held, strict=True)]
            known = [ref.key in done_in_index and reg is not None and reg.fid == fid
                     and reg.sha256 == ref.sha256 and not far
                     for ref, reg, far in zip(batch, regs, away, strict=True)]
            said = [k for k, is_known in zip(names, known, strict=True) if is_known]
            there = dict(zip(said, pool.map(lambda x: _still_there(store, *x),
                                            zip(said, index.done_sizes(said), strict=True)),
                             strict=True))
            plan.redo.update(k for k, ok in there.items() if not ok)
            known = [there.get(k, False) for k in names]
            unsure = [k for k, is_known in zip(names, known, strict=True) if not is_known]
            doubted = dict(zip(unsure, index.in_question(unsure), strict=True))
            heads = pool.map(lambda x: None if x[1] else _existing(store, x[0].key),
                             zip(batch, known, strict=True))
            for ref, reg, is_known, head, far in zip(batch, regs, known, heads, away,
                                                     strict=True):
                _check_one(plan, ref, reg, head, store, is_known, doubted.get(ref.key, False))
                if key_digest(ref.key) in plan.done:
                    plan.redo.discard(ref.key)
                elif far:
                    plan.done.add(key_digest(ref.key))
                    plan.done_elsewhere.add(key_digest(ref.key))
                if ref.key in plan.relearn:
                    with contextlib.suppress(OSError):
                        plan.relearn_at[ref.key] = store.final_path(ref.key).stat().st_mtime
    return plan


def _still_there(store: st.OutputStore, key: str, size_bytes: int | None) -> bool:
    """A done sample's final file is in the output dir at the size it was verified at (one
    ``stat``: its data is ``audit``'s to read)."""
    try:
        size = store.final_path(key).stat().st_size
    except OSError:
        return False
    return size_bytes is None or size == size_bytes


def _verifies(store: st.OutputStore, ref: SampleRef) -> bool:
    """The final file of ``ref`` reads back whole (every checksum: the data is read)."""
    try:
        store.verify(ref.key, ref.sha256)
    except (OSError, Corrupt):
        return False
    return True


def _check_one(plan: _Plan, ref: SampleRef, reg: Registered | None,
               head: tensorfile.Header | None, store: st.OutputStore, known_done: bool,
               doubted: bool = False) -> None:
    digest = key_digest(ref.key)
    plan.keys_seen.add(digest)
    fingerprint_id = store.fingerprint.id
    theirs = _conflict(ref, plan.fid, reg, head, fingerprint_id, plan.own_paths)
    if theirs:
        plan.n_conflicts += 1
        if len(plan.conflicts) < SHOW:
            plan.conflicts.append(f"record {ref.index}: sample key {ref.key!r} {theirs}")
    elif known_done:
        plan.done.add(digest)
    elif head is None or head.metadata.get(finalfile.M_FINGERPRINT) != fingerprint_id:
        return
    elif head.metadata.get(finalfile.M_CONTENT) == ref.sha256:
        if store.header_problems(head):  # not this run's dtypes or shapes: extracted again
            return
        if doubted and not _verifies(store, ref):  # an attempt found it damaged, or runs
            return
        plan.done.add(digest)
        plan.relearn[ref.key] = (head.size_bytes, head.shapes.get(T_INPUT_IDS, (0,))[0])
        plan.relearn_sha[ref.key] = ref.sha256
    else:  # this file's record under this key, corrected since its file was written
        plan.superseded.add(ref.key)


def _conflict(ref: SampleRef, fid: int, reg: Registered | None, head: tensorfile.Header | None,
              fingerprint_id: str, own_paths: set[str]) -> str | None:
    """Why ``ref`` cannot have its key in this run, or None."""
    if reg is not None and reg.fid != fid and reg.sha256 != ref.sha256:
        return f"is already used by record {reg.index} of data file #{reg.fid}"
    if head is None or head.metadata.get(finalfile.M_FINGERPRINT) != fingerprint_id:
        return None
    src = head.metadata.get(finalfile.M_SOURCE_FILE)
    if (head.metadata.get(finalfile.M_CONTENT) != ref.sha256 and src is not None
            and src not in own_paths and not (reg is not None and reg.fid == fid)):
        return f"already holds another record, from {src}"
    return None


def run_lock_name(run_id: str) -> str:
    return keys.run_key(run_id, keys.ENQUEUE_LOCK)


def open_run(settings: Settings, fingerprint: Fingerprint,
             model_path: Path | None) -> st.OutputStore:
    """The output dir of the run (the run id comes from its manifest: worker/core/run.py), its
    manifest written with ``model_path``'s weights identity if no worker wrote it yet.

    The weights of a run already begun are the workers' to check: samples may be queued
    while the server is being put right, and wait for it.

    Raises:
        ConfigError: the dir holds another fingerprint's run.
    """
    if (settings.output_dir / outdir.MANIFEST).exists():
        return st.OutputStore(settings.output_dir, fingerprint).open()
    return st.OutputStore(settings.output_dir, fingerprint,
                          versions={"hsfarm": PATCH_VERSION, "model_path": str(model_path)},
                          model_path=model_path).open()


def enqueue(settings: Settings, fingerprint: Fingerprint, path: Path, app: Any, *,
            dry_run: bool = False, limit: int | None = None, retry_failed: bool = False,
            meter: Meter = no_meter, model_path: Path | None = None,
            delete_removed: bool = False, redo_hosts: tuple[str, ...] = ()) -> Summary:
    """Publish tasks for every valid, not-yet-done sample of ``path``, through ``app``.

    ``redo_hosts``: unheard hosts (``worker.state.hosts.unheard``) whose samples may be redone.

    Raises:
        DataFileError: the file cannot be read as records at all.
        EnqueueRefused: keys clash with the run's other files, or a host lost its registrations.
        ConfigError: Redis keeps nothing on disk (not allowed), or the dir is another run's.
    """
    r = broker.client(settings)
    if not dry_run:
        broker.check_persistence(r, settings)
    _file_version(path)  # a missing file is a DataFileError before any lock is taken
    store = st.OutputStore(settings.output_dir, fingerprint)
    if not dry_run or (settings.output_dir / outdir.MANIFEST).exists():
        store = open_run(settings, fingerprint, model_path)  # a dry run begins no run
    run_id = store.run_id or NO_RUN
    queue = runs.queue_for(settings, run_id)
    index = RunIndex(r, run_id)
    abs_path = str(path.resolve())
    summary = Summary()
    others = queue_scan.note_queue(r, queue, run_id) if not dry_run else []
    if others:
        summary.notes.append(("FARM_QUEUE", queue_scan.sharing_warning(queue, run_id, others)))
    _check_hosts(r, run_id, settings, redo_hosts, dry_run)
    with leases.held(r, run_lock_name(run_id), settings.lease_ttl_s,
                     deadline=math.inf, poll_s=1.0):
        t0 = time.monotonic()
        corpus = Corpus(index)
        sha, size = file_sha256(path), _file_version(path)[0]
        found = corpus.lookup(abs_path, sha)
        moved_and_edited = 0 if found.fid else corpus.predecessor(_first_keys(settings, path))
        if moved_and_edited:
            found = Identified(moved_and_edited, corpus.files()[moved_and_edited].path)
        if not dry_run:
            found = corpus.identify(abs_path, sha, size, moved_and_edited)
        summary.fid, summary.moved_from = found.fid, found.moved_from
        refs = _refs(settings, path, limit, meter, "check", Summary())
        plan = _check(index, store, path, found.fid, refs,
                      corpus.paths_of(found.fid) | {abs_path}, hosts.host_id(settings))
        summary.decide_s = time.monotonic() - t0
        if plan.n_conflicts:
            raise EnqueueRefused(
                f"{path}: {plan.n_conflicts} record(s) would take sample keys this run already "
                f"gives to other records: {'; '.join(plan.conflicts)}. Keys must be unique "
                "within a run: give these records distinct ids (or enqueue them into a new "
                "FARM_OUTPUT_DIR). Nothing was published.")
        _publish(settings, app, queue, index, store, path, plan, summary, dry_run=dry_run,
                 limit=limit, retry_failed=retry_failed, meter=meter,
                 delete_removed=delete_removed)
        summary.publish_s = time.monotonic() - t0 - summary.decide_s
        if _file_version(path) != plan.version:
            summary.problems.append(("the file", "changed while it was enqueued; run enqueue "
                                                 "again once it is complete"))
        if not dry_run:  # what restores the run's record (ledger.py)
            ledger.record(r, run_id, settings.output_dir, abs_path, limit)
    return summary


def _check_hosts(r: redis.Redis, run_id: str, settings: Settings, redo: tuple[str, ...],
                 dry_run: bool) -> None:
    """Raises EnqueueRefused while a host this output dir knows in the run has not registered
    its files in this Redis (it lost them): its samples would be extracted twice."""
    missing = hosts.unheard(r, run_id, settings.output_dir)
    missing.pop(hosts.host_id(settings), None)  # this host's files are read here
    unknown = sorted(set(redo) - set(missing))
    if unknown:
        raise EnqueueRefused(f"--redo-host {', '.join(unknown)}: not a host this run has not "
                             f"heard from (those are: {', '.join(sorted(missing)) or 'none'})")
    if redo and not dry_run:
        hosts.forget_hosts(settings.output_dir, redo)
    left = {h: e for h, e in missing.items() if h not in redo}
    if left:
        named = "; ".join(f"{h} (output {e.get('output_dir', '?')})"
                          for h, e in sorted(left.items()))
        raise EnqueueRefused(
            f"this run's Redis has not heard from host(s) {named} since it lost its data: their "
            "finished files are not known here, and would be extracted again. Start their "
            "workers (they register what their output dir holds), then run enqueue again; or, "
            f"if they are gone for good, --redo-host {' --redo-host '.join(sorted(left))} to "
            "extract their samples again. Nothing was published.")
def _first_keys(settings: Settings, path: Path, n: int = 64) -> list[str]:
    """The sample keys of the first ``n`` valid records of ``path``."""
    return [ref.key for ref in sample_refs(path, settings.max_record_bytes, [], [], limit=n,
                                           prompts=settings.regenerate)]


def _refs(settings: Settings, path: Path, limit: int | None, meter: Meter, desc: str,
          summary: Summary) -> Iterator[SampleRef]:
    with meter(desc, path.stat().st_size) as reached:
        yield from sample_refs(path, settings.max_record_bytes, summary.rejected,
                               summary.problems, limit, progress=reached, notes=summary.notes,
                               prompts=settings.regenerate)


def _rejected_for_content(body: dict[str, Any] | None, sha256: str) -> bool:
    """This content was rejected for itself (a rejection for an answer of the server or a
    gateway is published again)."""
    return (body is not None and body.get("sha") == sha256
            and not environmental_rejection(str(body.get("reason", ""))))


def _publish(settings: Settings, app: Any, queue: str, index: RunIndex,
             store: st.OutputStore, path: Path, plan: _Plan, summary: Summary, *,
             dry_run: bool, limit: int | None, retry_failed: bool, meter: Meter,
             delete_removed: bool = False) -> None:
    """Pass 2: register and publish what is not done, queued, running or settled."""
    r = index.r
    in_broker = broker_sample_keys(r, queue, index.run_id)
    publication = 0 if dry_run else index.next_publication()
    rejected_before = index.outcomes(keys.REJECTED)
    failed_before = index.outcomes(keys.FAILED)
    settled = (set(rejected_before) | set(failed_before) | set(index.outcomes(keys.STALE))
               | set(Corpus(index).parked()))
    summary.redone = len(plan.redo)
    if not dry_run:
        index.unmark_done(sorted(plan.redo))
        index.mark_done_many(plan.relearn, plan.relearn_at)
        hosts.claim(r, index.run_id, hosts.host_id(settings), plan.relearn_sha)
        index.clear_invalid(plan.fid)
    refs = _refs(settings, path, limit, meter, "enqueue", summary)
    with app.producer_or_acquire() as producer, \
            producer.batch(max_size=500):
        for batch in _batches(refs):
            if not dry_run:
                index.register({ref.key: Registered(plan.fid, ref.offset, ref.length,
                                                    ref.sha256, ref.index) for ref in batch})
            leased = index.leased([ref.key for ref in batch])
            for ref, busy in zip(batch, leased, strict=True):
                summary.records += 1
                if ref.key in plan.superseded:
                    _supersede(index, store, ref.key, summary, dry_run, delete_removed)
                if key_digest(ref.key) in plan.done:
                    summary.already_done += 1
                    summary.done_elsewhere += key_digest(ref.key) in plan.done_elsewhere
                elif busy or ref.key in in_broker:
                    summary.already_queued += 1
                elif _rejected_for_content(rejected_before.get(ref.key), ref.sha256):
                    summary.previously_rejected += 1
                elif ref.key in failed_before and not retry_failed:
                    summary.previously_failed += 1
                else:
                    if not dry_run:
                        if ref.key in settled or ref.key in plan.redo:
                            index.forget_outcome(ref.key)
                        publish.send(app, queue, index.run_id, publication,
                                     replace(ref, fid=plan.fid), producer)
                    summary.published += 1
    summary.records += len(summary.rejected)
    if not dry_run:
        for where, reason in summary.rejected:
            index.add_invalid(plan.fid, where, reason)
        if limit is None:
            _drop_vanished(index, store, plan, summary, str(path.resolve()), delete_removed)
            Corpus(index).clear_unreadable(plan.fid)
        index.set_meta(last_enqueue=str(path.resolve()))
        if summary.published:
            index.mark_started()


def _drop_vanished(index: RunIndex, store: st.OutputStore, plan: _Plan, summary: Summary,
                   path: str, delete: bool) -> None:
    """Samples this file registered before and holds no more leave the run; the output
    files of those done are set aside. Streams the registry: constant memory."""
    gone = [key for key, reg in index.iter_registered()
            if reg.fid == plan.fid and key_digest(key) not in plan.keys_seen]
    for key in gone:
        summary.set_aside += setaside.set_aside(store.out_dir, key, delete) is not None
    index.unregister(gone, reason="its record was removed from its data file", file=path)
    summary.removed = len(gone)


def _supersede(index: RunIndex, store: st.OutputStore, key: str, summary: Summary,
               dry_run: bool, delete: bool) -> None:
    """``key``'s record was corrected after its file was written: the file is set aside and
    the sample is no longer done."""
    summary.superseded += 1
    if not dry_run:
        summary.set_aside += setaside.set_aside(store.out_dir, key, delete) is not None
        index.unmark_done([key])


def requeue(settings: Settings, store: st.OutputStore, refs: list[SampleRef], app: Any) -> int:
    """Publish ``refs`` again in the run of ``store`` (opened), clearing their failed/rejected
    marks, through the Celery ``app``. Returns how many."""
    r = broker.client(settings)
    run_id, queue = store.run_id, runs.queue_for(settings, store.run_id)
    index = RunIndex(r, run_id)
    in_broker = broker_sample_keys(r, queue, run_id)
    publication = index.next_publication()
    sent = 0
    with leases.held(r, run_lock_name(run_id), settings.lease_ttl_s,
                     deadline=math.inf, poll_s=1.0), app.producer_or_acquire() as producer, \
            producer.batch(max_size=500):
        for ref, busy in zip(refs, index.leased([x.key for x in refs]), strict=True):
            if busy or ref.key in in_broker:
                continue
            index.forget_outcome(ref.key)
            publish.send(app, queue, run_id, publication, ref, producer)
            sent += 1
    return sent
