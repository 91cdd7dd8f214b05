"""Publish one idempotent task per sample.

Re-running is always safe: a sample is not published again when its final file is on disk
(header names this sample, content and run), when its task is already in the broker (queued or
unacknowledged), or when the run already rejected or gave up on this exact content. Task ids
are deterministic from (fingerprint, sample key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from tqdm import tqdm

from producer.queue_scan import broker_task_ids
from producer.reader import DataFileError, FileProblem, scan
from sglang_patch import contracts as c
from worker import keys
from worker.app import TASK_NAME, app
from worker.errors import BadInput
from worker.index import RunIndex
from worker.samples import SampleRef, content_hash, parse_record
from worker.settings import Settings
from worker.store import OutputStore


@dataclass
class Summary:
    records: int = 0
    published: int = 0
    already_done: int = 0
    already_queued: int = 0
    previously_rejected: int = 0
    previously_failed: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (where, reason)
    problems: list[tuple[str, str]] = field(default_factory=list)  # file-level, not records
    notes: list[tuple[str, str]] = field(default_factory=list)  # accepted, but worth knowing

    def lines(self) -> list[str]:
        out = [
            f"records: {self.records}",
            f"published: {self.published}",
            f"already done: {self.already_done}",
            f"already queued or running: {self.already_queued}",
            f"rejected: {len(self.rejected)}",
        ]
        if self.previously_rejected or self.previously_failed:
            out.append(f"skipped, rejected/failed earlier in this run: "
                       f"{self.previously_rejected}/{self.previously_failed} "
                       "(see 'status --failures'; --retry-failed retries the failed)")
        out += [f"  {where}: {reason}" for where, reason in self.problems + self.rejected]
        out += [f"  note, {where}: {text}" for where, text in self.notes]
        return out

    @property
    def ok(self) -> bool:
        return not (self.rejected or self.problems)


def task_id(fingerprint_id: str, key: str) -> str:
    return f"hsd-{fingerprint_id}-{key}"


def publish(producer: Any, settings: Settings, fingerprint: c.Fingerprint,
            ref: SampleRef) -> None:
    """Send one task (within a ``producer_or_acquire`` block, batched by the caller)."""
    app.send_task(TASK_NAME, args=[ref.to_json()], task_id=task_id(fingerprint.id, ref.key),
                  queue=settings.queue, producer=producer)


def requeue(settings: Settings, fingerprint: c.Fingerprint, refs: list[SampleRef]) -> int:
    """Publish ``refs`` again, clearing their failed/rejected marks. Returns how many."""
    index = RunIndex(redis.Redis.from_url(settings.redis_url), fingerprint.id)
    in_broker = broker_task_ids(index.r, settings.queue)
    sent = 0
    with app.producer_or_acquire() as producer, producer.batch(max_size=500):
        for ref in refs:
            if task_id(fingerprint.id, ref.key) in in_broker:
                continue
            index.forget_outcome(ref.key)
            publish(producer, settings, fingerprint, ref)
            sent += 1
    return sent


def sample_refs(path: Path, rejected: list[tuple[str, str]],
                problems: list[tuple[str, str]], limit: int | None = None,
                progress: Callable[[int], None] | None = None,
                notes: list[tuple[str, str]] | None = None) -> Iterator[SampleRef]:
    """The valid records of ``path`` as task references, in file order.

    Invalid records go to ``rejected`` and broken stretches of the file to ``problems``, each
    as (where, reason); a record whose id repeats an earlier one is rejected as a duplicate.
    Memory grows with the number of records (their keys), not with the file's size.
    """
    seen: dict[str, str] = {}
    abs_path = str(path.resolve())
    count = 0
    for item in scan(path):
        if isinstance(item, FileProblem):
            problems.append((item.where, item.reason))
            continue
        if limit is not None and count >= limit:
            return
        count += 1
        if progress is not None:
            progress(item.offset + len(item.raw))
        try:
            sample = parse_record(item.raw)
        except BadInput as e:
            rejected.append((item.where, str(e)))
            continue
        key = c.sample_key_for(sample.source_id, item.index)
        if key in seen:
            rejected.append((item.where, f"duplicate id {sample.source_id!r} "
                                         f"(same sample key as {seen[key]})"))
            continue
        seen[key] = item.where
        if notes is not None and sample.source_id is not None and key != sample.source_id:
            notes.append((item.where, f"id {str(sample.source_id)[:60]!r} is not usable as a "
                                      f"file name; its sample key is {key!r}"))
        yield SampleRef(key=key, file=abs_path, offset=item.offset, length=len(item.raw),
                        sha256=content_hash(item.raw), index=item.index)


def enqueue(settings: Settings, fingerprint: c.Fingerprint, path: Path, *,
            dry_run: bool = False, limit: int | None = None, retry_failed: bool = False,
            progress: bool = True) -> Summary:
    """Publish tasks for every valid, not-yet-done sample of ``path``.

    Raises:
        DataFileError: the file cannot be read as records at all.
    """
    r = redis.Redis.from_url(settings.redis_url)
    index = RunIndex(r, fingerprint.id)
    store = OutputStore(settings.output_dir, fingerprint)
    in_broker = broker_task_ids(r, settings.queue)
    rejected_before = index.outcomes(keys.REJECTED)
    failed_before = index.outcomes(keys.FAILED)
    summary = Summary()
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataFileError(f"{path}: {e.strerror}") from e
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="enqueue",
               disable=not progress)
    refs = sample_refs(path, summary.rejected, summary.problems, limit,
                       progress=lambda at: bar.update(at - bar.n), notes=summary.notes)
    with bar, app.producer_or_acquire() as producer, producer.batch(max_size=500):
        for ref in refs:
            summary.records += 1
            tid = task_id(fingerprint.id, ref.key)
            if tid in in_broker:
                summary.already_queued += 1
            elif store.quick_check(ref.key, ref.sha256):
                summary.already_done += 1
            elif rejected_before.get(ref.key, {}).get("sha") == ref.sha256:
                summary.previously_rejected += 1
            elif ref.key in failed_before and not retry_failed:
                summary.previously_failed += 1
            else:
                if not dry_run:
                    if ref.key in failed_before or ref.key in rejected_before:
                        index.forget_outcome(ref.key)
                    publish(producer, settings, fingerprint, ref)
                summary.published += 1
    summary.records += len(summary.rejected)
    if not dry_run:
        for where, reason in summary.rejected:
            index.mark_rejected(f"@{where}", reason, record=where)
        index.set_meta(total=summary.records, data_file=str(path.resolve()))
        index.add_data_file(str(path.resolve()))
    return summary
