"""``export``: stream every sample of an output dir into a trainer's container, never losing one.

Per sample: read the source and check its header against the manifest; write the
output to a temp file, fsync, drop it from the page cache and read it back from the disk;
compare every output tensor with the source's recorded checksums (which also catches a
damaged source) or, where derived, with what was computed; rename into place, fsync the
directory; append a ledger line (fsync); only then, with ``delete_source``, remove the
source. A crash at any point leaves the source or a ledger line, so re-running resumes:
samples in the ledger whose file is there are skipped, the rest are redone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sglang_patch import contracts as c
from training import checksums, durable, index
from training.export.formats import FORMATS, Format
from training.export.ledger import Ledger
from training.manifest import RunInfo, load_run_info
from training.sample_file import SampleFile
from worker.errors import ConfigError, Corrupt
from worker.store import _writer_dead as writer_dead  # the store's own temp-name parser
from worker.store import free_bytes

MARGIN_BYTES = 64 << 20


@dataclass
class ExportSummary:
    """What an export did; ``ok`` when nothing failed."""

    exported: int = 0
    skipped: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    deleted_sources: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    def lines(self, show: int = 50) -> list[str]:
        rate = self.bytes_written / self.seconds / 1e6 if self.seconds else 0.0
        out = [f"exported: {self.exported} samples, {self.bytes_written / 1e6:.1f} MB in "
               f"{self.seconds:.1f}s ({rate:.1f} MB/s)",
               f"skipped (already exported and verified): {self.skipped}",
               f"sources deleted: {self.deleted_sources}", f"failed: {len(self.failed)}"]
        return out + [f"  failed {k}: {why}" for k, why in self.failed[:show]]


@dataclass
class _Job:
    info: RunInfo
    fmt: Format
    dest: Path
    ledger: Ledger
    norm_w: np.ndarray | None
    delete_source: bool
    throttle_s: float = 0.0  # tests: slow each sample down to kill an export mid-way
    lock: threading.Lock = field(default_factory=threading.Lock)


def export(out_dir: Path, to: str, dest: Path, jobs: int = 2, delete_source: bool = False,
           progress: Callable[[int], None] | None = None,
           throttle_s: float = 0.0) -> ExportSummary:
    """Export every sample of ``out_dir`` not yet exported. Raises ConfigError up front."""
    if to not in FORMATS:
        raise ConfigError(f"unknown export format {to!r}: one of {', '.join(FORMATS)}")
    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, not {jobs}")
    info = load_run_info(out_dir)
    fmt = FORMATS[to]
    norm_w = info.final_norm().as_float32() if fmt.needs_norm else None
    dest.mkdir(parents=True, exist_ok=True)
    _remove_dead_temps(dest)
    ledger = Ledger(dest)
    sources = list(index.sample_files(out_dir))
    pending = [p for p in sources if not _done(ledger, dest, _key(p))]
    summary = ExportSummary(skipped=len(ledger.entries))
    if delete_source:  # a crash between the ledger line and the unlink left these behind
        summary.deleted_sources = _delete_exported(sorted(set(sources) - set(pending)))
    check_space(dest, out_dir, pending, delete_source, jobs)
    job = _Job(info, fmt, dest, ledger, norm_w, delete_source, throttle_s)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for key, result in zip(map(_key, pending), pool.map(lambda p: _one(job, p), pending),
                               strict=True):
            if isinstance(result, str):
                summary.failed.append((key, result))
            else:
                summary.exported += 1
                summary.bytes_written += result
                summary.deleted_sources += int(delete_source)
            if progress:
                progress(1)
    if fmt.numbered:
        from training.export.speculators_dataset import write_dataset

        write_dataset(dest, ledger)
    summary.seconds = time.monotonic() - t0
    return summary


def _remove_dead_temps(dest: Path) -> None:
    """Temp files left by an export that was killed (this host, writer gone)."""
    for p in dest.rglob(f"*{c.TMP_MARK}*"):
        if writer_dead(p.name):
            p.unlink(missing_ok=True)


def _delete_exported(paths: list[Path]) -> int:
    """Remove sources whose export is in the ledger and whose file is there."""
    for p in paths:
        p.unlink()
        durable.fsync_dir_of(p)
    return len(paths)


def _key(path: Path) -> str:
    return path.name[: -len(c.DUMP_SUFFIX)]


def _done(ledger: Ledger, dest: Path, key: str) -> bool:
    entry = ledger.entries.get(key)
    if entry is None:
        return False
    path = dest / entry["path"]
    return path.exists() and path.stat().st_size == entry["bytes"]


def check_space(dest: Path, out_dir: Path, pending: list[Path], delete_source: bool,
                jobs: int) -> None:
    """Refuse to start when DEST cannot hold what is left to export; say how much is missing.

    With ``delete_source`` on the same file system, each source is removed after its export
    verified, so only ``jobs`` samples in flight need room.
    """
    sizes = sorted((p.stat().st_size for p in pending), reverse=True)
    same_fs = os.stat(dest).st_dev == os.stat(out_dir).st_dev
    need = sum(sizes[:jobs] if delete_source and same_fs else sizes) + MARGIN_BYTES
    free = free_bytes(dest)
    if need > free:
        raise ConfigError(
            f"{dest} has {free / 1e9:.2f} GB free; exporting {len(pending)} samples needs "
            f"about {need / 1e9:.2f} GB: {(need - free) / 1e9:.2f} GB missing. Free space, or "
            "pass --delete-source (each source removed once its export verified"
            f"{'' if same_fs else '; DEST must then be on the same file system'})")


def _one(job: _Job, src_path: Path) -> int | str:
    """Export one sample; its size in bytes, or the reason it failed (never raises)."""
    key = _key(src_path)
    tmp = None
    try:
        src = SampleFile.open(src_path)
        job.info.check_sample(src, key)
        src_sums = checksums.recorded(src.metadata)
        arrays = src.read_all()
        tmp = durable.tmp_for(job.dest / job.fmt.rel_path(key, 0))
        tmp.parent.mkdir(parents=True, exist_ok=True)
        derived = job.fmt.write(tmp, key, arrays, src_sums, job.norm_w)
        _verify_from_disk(job.fmt, tmp, src_sums, derived)
        if job.throttle_s:
            time.sleep(job.throttle_s)
        return _commit(job, key, tmp, src_path, src_sums)
    except (Corrupt, OSError, ValueError, KeyError, RuntimeError) as e:
        return str(e) or type(e).__name__
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _verify_from_disk(fmt: Format, tmp: Path, src_sums: checksums.Recorded,
                      derived: dict[str, np.ndarray]) -> None:
    """Read the synced temp file back from the disk; Corrupt unless every tensor matches."""
    durable.fsync_file(tmp)
    durable.drop_cache(tmp)
    problems = fmt.problems(fmt.read_back(tmp), src_sums, derived)
    if problems:
        raise Corrupt("export did not verify: " + "; ".join(problems))


def _commit(job: _Job, key: str, tmp: Path, src_path: Path,
            src_sums: checksums.Recorded) -> int:
    """Rename into place, record in the ledger, then (optionally) delete the source."""
    size = tmp.stat().st_size
    with job.lock:  # numbered files: the next number, given only to a verified file
        number = len(job.ledger.entries) if job.fmt.numbered else 0
        rel = job.fmt.rel_path(key, number)
        (job.dest / rel).parent.mkdir(parents=True, exist_ok=True)
        durable.commit(tmp, job.dest / rel)
        job.ledger.add({"key": key, "path": rel, "number": number, "bytes": size,
                        "source_checksums": src_sums.to_json()})
    if job.delete_source:
        src_path.unlink()
        durable.fsync_dir_of(src_path)
    return size
