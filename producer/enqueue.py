"""Publish one idempotent task per sample.

Re-running is always safe: a sample is not published again when its final file is on disk
(header names this sample, content and run), when its task is already in the broker (queued or
unacknowledged), or when the run already rejected or gave up on this exact content. Task ids
are deterministic from (fingerprint, sample key).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from tqdm import tqdm

from producer.queue_scan import broker_task_ids
from producer.reader import FileProblem, Span, scan
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
        return out

    @property
    def ok(self) -> bool:
        return not (self.rejected or self.problems)


def task_id(fingerprint_id: str, key: str) -> str:
    return f"hsd-{fingerprint_id}-{key}"


@dataclass
class _Candidate:
    ref: SampleRef
    where: str


def _candidates(path: Path, summary: Summary, limit: int | None,
                bar: tqdm) -> Iterator[_Candidate]:
    """Valid records with their keys; invalid ones go to ``summary.rejected``."""
    seen: dict[str, str] = {}
    abs_path = str(path.resolve())
    for item in scan(path):
        if isinstance(item, FileProblem):
            summary.problems.append((item.where, item.reason))
            continue
        assert isinstance(item, Span)
        if limit is not None and summary.records >= limit:
            return
        summary.records += 1
        bar.update(item.offset + len(item.raw) - bar.n)
        try:
            sample = parse_record(item.raw)
        except BadInput as e:
            summary.rejected.append((item.where, str(e)))
            continue
        key = c.sample_key_for(sample.source_id, item.index)
        if key in seen:
            summary.rejected.append((item.where, f"duplicate id {sample.source_id!r} "
                                                 f"(same sample key as {seen[key]})"))
            continue
        seen[key] = item.where
        ref = SampleRef(key=key, file=abs_path, offset=item.offset, length=len(item.raw),
                        sha256=content_hash(item.raw), index=item.index)
        yield _Candidate(ref, item.where)


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
    bar = tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc="enqueue",
               disable=not progress)
    with bar, app.producer_or_acquire() as producer, producer.batch(max_size=500):
        for cand in _candidates(path, summary, limit, bar):
            ref, tid = cand.ref, task_id(fingerprint.id, cand.ref.key)
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
                    app.send_task(TASK_NAME, args=[ref.to_json()], task_id=tid,
                                  queue=settings.queue, producer=producer)
                summary.published += 1
    if not dry_run:
        for where, reason in summary.rejected:
            index.mark_rejected(f"@{where}", reason, record=where)
        index.set_meta(total=summary.records,
                       data_file=str(path.resolve()))
    return summary
