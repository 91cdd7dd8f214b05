"""``export``: stream every sample of an output dir into a trainer's container, never losing one.

Per sample: a temp file, fsynced, dropped from the page cache, read back and compared with the
source's checksums, renamed, the dir fsynced, a ledger line appended (fsync); only then may
``delete_source`` remove the source, if its bytes are still the exported ones. A sample is
skipped only when its ledger line and DEST file match the source; a crash leaves the source
or a ledger line, so a re-run resumes. One export per DEST (``lock``); records that left the
corpus are withdrawn. Test: tests/farm/test_training.py::test_sigkill_mid_export_loses_nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine_dump.dumpfile import DUMP_SUFFIX, TMP_MARK
from training import fp8, roots
from training.export.formats import FORMATS, Format
from training.export.ledger import Ledger
from training.export.lock import dest_lock
from training.export.numbered import close_gaps
from training.manifest import RunInfo, load_run_info
from training.sample_file import SampleFile
from worker.core import checksums, diskio, durable, outdir
from worker.core.diskio import free_bytes, is_no_space
from worker.core.errors import ConfigError, Corrupt
from worker.core.finalfile import conversation_of
from worker.core.setaside import removed_by_key
from worker.core.units import size_text

MARGIN_BYTES = 64 << 20
# Samples exported at once: one sample's CPU work (the save's page faults, speculators'
# derivation, the read-back's hashing) overlaps the other's disk I/O. Measured against one
# stream at 86 and 470 MB samples (bench/training_io.py, docs/benchmarks.md): 2 was faster
# in every run at both sizes (1.02-1.47x, median 1.27x) on this project's VM disk, so one
# default fits both; a disk that two streams slow down is the case for --jobs 1.
DEFAULT_JOBS = 2


@dataclass
class ExportSummary:
    """What an export did; ``ok`` when nothing failed."""

    exported: int = 0
    skipped: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    deleted_sources: int = 0
    withdrawn: int = 0  # left DEST: their records left the corpus
    failed: list[tuple[str, str]] = field(default_factory=list)
    doubles: list[str] = field(default_factory=list)  # samples in two roots: which was kept

    @property
    def ok(self) -> bool:
        return not self.failed

    def lines(self, show: int = 50) -> list[str]:
        rate = self.bytes_written / self.seconds / 1e6 if self.seconds else 0.0
        out = [f"exported: {self.exported} samples, {self.bytes_written / 1e6:.1f} MB in "
               f"{self.seconds:.1f}s ({rate:.1f} MB/s)",
               f"skipped (already exported and verified): {self.skipped}",
               f"sources deleted: {self.deleted_sources}",
               f"withdrawn (removed from the corpus): {self.withdrawn}",
               f"failed: {len(self.failed)}"]
        out += [f"  failed {k}: {why}" for k, why in self.failed[:show]]
        return out + self.doubles


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
    shared: set[int] = field(default_factory=set)  # numbers more than one key claims
    next_number: int = 0
    # the first write into DEST that found no space: the samples left are not tried
    full: BaseException | None = None


class DestFull(ConfigError):
    """DEST ran out of space mid-export, whichever writer found it (torch.save, pyarrow, the
    ledger's or our own writes): the export stops; what verified stays for the next run."""


_NOT_TRIED = "not exported: DEST is full"


def no_space(e: BaseException | None) -> bool:
    """ENOSPC/EDQUOT anywhere in ``e``'s chain. torch.save's zip writer reports a failed write
    of its file object as "unexpected pos", with the OSError as its context; pyarrow raises an
    OSError with the errno; safetensors names it in its message (``diskio.is_no_space``)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if is_no_space(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _dest_full(job: _Job, summary: ExportSummary) -> DestFull:
    left = sum(1 for _, why in summary.failed if why in (_NOT_TRIED, "DEST is full"))
    return DestFull(
        f"DEST is full: {job.dest} ran out of space ({free_bytes(job.dest) / 1e6:.1f} MB free) "
        f"with {summary.exported} samples exported and verified in this run "
        f"({summary.skipped} were already there), {left} not exported. Free space on it (or "
        "pass --delete-source), then run the same export again: it keeps what verified and "
        "exports the rest")


@dataclass(frozen=True)
class _Outcome:
    exported_bytes: int = 0  # 0: skipped, already in DEST and verified
    deleted: bool = False


def export(out_dir: Path, to: str, dest: Path, jobs: int = DEFAULT_JOBS,
           delete_source: bool = False, progress: Callable[[int], None] | None = None,
           throttle_s: float = 0.0, also: Sequence[Path] = ()) -> ExportSummary:
    """Export every sample of ``out_dir`` not yet in DEST as it is now.

    Raises:
        ConfigError: up front: bad arguments, not an output dir, no room, or another export
            into DEST is running.
        DestFull: (a ConfigError) DEST ran out of space mid-export, whichever writer found
            it; the samples not yet exported are not tried.
    """
    if to not in FORMATS:
        raise ConfigError(f"unknown export format {to!r}: one of {', '.join(FORMATS)}")
    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, not {jobs}")
    info = load_run_info(out_dir)
    fmt = FORMATS[to]
    norm_w = info.final_norm().as_float32() if fmt.needs_norm else None
    dest.mkdir(parents=True, exist_ok=True)
    with dest_lock(dest):
        _remove_dead_temps(dest)
        job = _Job(info, fmt, dest, Ledger(dest), norm_w, delete_source, throttle_s)
        return _export(job, [out_dir, *also], jobs, progress)


def _export(job: _Job, out_dirs: list[Path], jobs: int,
            progress: Callable[[int], None] | None) -> ExportSummary:
    roots.check_same_run(out_dirs)
    gathered = roots.gather(out_dirs)
    sources = gathered.files
    pending = [p for k, p in sources.items() if _changed(job, k, p)]
    check_space(job.info, job.dest, out_dirs[0], pending, job.delete_source, jobs)
    if job.fmt.numbered:
        numbers = job.ledger.numbers()
        job.shared = {n for n, keys in numbers.items() if len(keys) > 1}
        job.next_number = max(numbers, default=-1) + 1
    kept = [k for k in job.ledger.entries if k not in sources]
    summary = ExportSummary(doubles=gathered.lines())
    aside: dict[str, list[Path]] = {}
    for root in out_dirs:  # files kept aside in any root of the run
        for key, paths in removed_by_key(root).items():
            aside.setdefault(key, []).extend(paths)
    withdrawn = {k for k in kept if k in aside and _exported_version(job, k, aside[k])}
    for key in withdrawn:
        _withdraw(job, key)
    summary.withdrawn = len(withdrawn)
    kept = [k for k in kept if k not in withdrawn]
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # _one: ENOSPC sets job.full
        for key, result in zip(sources, pool.map(lambda p: _one(job, p), sources.values()),
                               strict=True):
            _count(summary, key, result)
            if progress:
                progress(1)
        for key, why in zip(kept, pool.map(lambda k: _check_kept(job, k), kept), strict=True):
            if why is None:
                summary.skipped += 1
            else:
                summary.failed.append((key, why))
    if job.full is not None:
        raise _dest_full(job, summary) from job.full
    if job.fmt.numbered:
        from training.export.speculators_dataset import write_dataset

        try:
            close_gaps(job.ledger, job.fmt, job.dest)
            write_dataset(job.dest, job.ledger)
        except (OSError, RuntimeError) as e:
            if no_space(e):
                raise _dest_full(job, summary) from e
            raise
    summary.seconds = time.monotonic() - t0
    return summary


def _exported_version(job: _Job, key: str, aside: list[Path]) -> bool:
    """One of the files kept aside for ``key`` is the version DEST holds (its checksums)."""
    exported = checksums.Recorded.from_json(job.ledger.entries[key]["source_checksums"])
    for path in aside:
        with contextlib.suppress(Corrupt, OSError):
            if checksums.recorded(SampleFile.open(path).metadata) == exported:
                return True
    return False


def _withdraw(job: _Job, key: str) -> None:
    """Take ``key`` out of DEST: its ledger line first, then its file (numbered layouts: the
    gap is closed after the export)."""
    path = job.dest / str(job.ledger.entries[key]["path"])
    job.ledger.remove(key)
    durable.remove(path, missing_ok=True)


def _count(summary: ExportSummary, key: str, result: _Outcome | str) -> None:
    if isinstance(result, str):
        summary.failed.append((key, result))
        return
    if result.exported_bytes:
        summary.exported += 1
        summary.bytes_written += result.exported_bytes
    else:
        summary.skipped += 1
    summary.deleted_sources += int(result.deleted)


def _remove_dead_temps(dest: Path) -> None:
    """Temp files left by an export that was killed (this host, writer gone)."""
    for p in dest.rglob(f".*{TMP_MARK}*"):
        if outdir.temp_writer_dead(p.name):
            p.unlink(missing_ok=True)


def _key(path: Path) -> str:
    return path.name[: -len(DUMP_SUFFIX)]


def _changed(job: _Job, key: str, path: Path) -> bool:
    """The source is not in the ledger as it is now (its header's checksums; no data read)."""
    entry = job.ledger.entries.get(key)
    if entry is None:
        return True
    try:
        now = checksums.recorded(SampleFile.open(path).metadata)
    except (Corrupt, OSError):
        return True
    return now != checksums.Recorded.from_json(entry["source_checksums"])


def check_space(info: RunInfo, dest: Path, out_dir: Path, pending: list[Path],
                delete_source: bool, jobs: int) -> None:
    """Refuse to start when DEST cannot hold what is left to export; say how much is missing.

    What an export writes is counted (an fp8 run's states in bf16: ~1.9x its sources). With
    ``delete_source`` on the same file system, each source is removed after its export
    verified, so only ``jobs`` samples in flight need room.
    """
    sizes = sorted((fp8.exported_bytes(info, p) for p in pending), reverse=True)
    same_fs = os.stat(dest).st_dev == os.stat(out_dir).st_dev
    need = sum(sizes[:jobs] if delete_source and same_fs else sizes) + MARGIN_BYTES
    free = free_bytes(dest)
    if need > free:
        raise ConfigError(
            f"{dest} has {size_text(free)} free; exporting {len(pending)} samples needs "
            f"about {size_text(need)}: {size_text(need - free)} missing. Free space, or "
            "pass --delete-source (each source removed once its export verified"
            f"{'' if same_fs else '; DEST must then be on the same file system'})")


def _one(job: _Job, src_path: Path) -> _Outcome | str:
    """Skip or export one sample; what happened, or the reason it failed (never raises)."""
    key = _key(src_path)
    if job.full is not None:
        return _NOT_TRIED
    tmp = None
    try:
        seen = os.stat(src_path)
        src = SampleFile.open(src_path)
        job.info.check_sample(src, key)
        src_sums = checksums.recorded(src.metadata)
        entry = job.ledger.entries.get(key)
        if entry is not None and not _dest_problems(job, entry, src_sums):
            return _Outcome(0, job.delete_source and _delete_verified(src, src_sums, seen))
        # mapped, asked for whole: the save writes from the page cache's pages (no buffer
        # of the sample's size allocated, zero-filled and copied into per export thread)
        arrays = src.map_all(prefetch=True)
        _same_file(src_path, seen)
        arrays, want = fp8.as_exported(job.info, arrays, src_sums)  # fp8 runs: bf16 out
        tmp = outdir.temp_path(job.dest / job.fmt.rel_path(key, 0))
        tmp.parent.mkdir(parents=True, exist_ok=True)
        derived_sums = job.fmt.write(tmp, key, arrays, want, job.norm_w)
        _verify_from_disk(job.fmt, tmp, want, derived_sums)
        if job.throttle_s:
            time.sleep(job.throttle_s)
        size = _commit(job, key, tmp, src_sums, derived_sums, entry, want,
                       conversation_of(src.metadata))
        return _Outcome(size, job.delete_source and _delete_if_same(src_path, seen))
    except (Corrupt, OSError, ValueError, KeyError, RuntimeError) as e:
        if no_space(e):
            job.full = job.full or e
            return "DEST is full"
        return str(e) or type(e).__name__
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _dest_problems(job: _Job, entry: dict[str, object], src_sums: checksums.Recorded) -> list[str]:
    """Why the ledger entry's file does not hold ``src_sums`` (read back from the disk)."""
    if checksums.Recorded.from_json(entry["source_checksums"]) != src_sums:  # type: ignore[arg-type]
        return ["the source changed since its export"]
    path = job.dest / str(entry["path"])
    if not path.is_file():
        return [f"{path.name} is missing from DEST"]
    derived = entry.get("output_checksums")
    exported = entry.get("exported_checksums")  # fp8 runs: what the bf16 outputs hold
    want = checksums.Recorded.from_json(exported) if isinstance(exported, dict) else src_sums
    try:
        diskio.drop_cache(path)
        return job.fmt.check(path, want, derived if isinstance(derived, dict) else None)
    except (Corrupt, OSError, ValueError, KeyError, RuntimeError) as e:
        return [f"{path.name} is unreadable: {e}"]


def _check_kept(job: _Job, key: str) -> str | None:
    """An entry whose source is gone: None when its file verifies, else why not. A file that
    is gone, or (numbered) holds another key's number, leaves the ledger."""
    entry = job.ledger.entries[key]
    problems = _dest_problems(job, entry, checksums.Recorded.from_json(entry["source_checksums"]))
    if not problems:
        return None
    lost = not (job.dest / entry["path"]).is_file() or entry.get("number") in job.shared
    if lost:
        job.ledger.remove(key)
    what = "lost" if lost else "damaged in DEST"
    return (f"{what}, and its source was deleted ({'; '.join(problems)}): extract it again "
            "(python -m producer audit requeues a sample whose file is missing)")


def _verify_from_disk(fmt: Format, tmp: Path, src_sums: checksums.Recorded,
                      derived_sums: dict[str, str]) -> None:
    """Read the synced temp file back from the disk; Corrupt unless every tensor matches."""
    diskio.fsync_file(tmp)
    diskio.drop_cache(tmp)
    problems = fmt.check(tmp, src_sums, derived_sums)
    if problems:
        raise Corrupt("export did not verify: " + "; ".join(problems))


def _commit(job: _Job, key: str, tmp: Path, src_sums: checksums.Recorded,
            derived_sums: dict[str, str], entry: dict[str, object] | None,
            exported: checksums.Recorded, conversation: dict[str, Any] | None) -> int:
    """Rename into place and record it in the ledger; the size written. ``exported``: the
    checksums the copies were compared with (an fp8 run's: of the bf16 tensors);
    ``conversation``: a regenerated sample's (``messages``, ``generation``), which its line
    carries, so every trainer's container says what conversation each file's states are of."""
    size = tmp.stat().st_size
    with job.lock:  # numbered files: a number is given only to a verified file
        number = _number(job, entry)
        rel = job.fmt.rel_path(key, number)
        (job.dest / rel).parent.mkdir(parents=True, exist_ok=True)
        durable.commit(tmp, job.dest / rel)
        job.ledger.add({"key": key, "path": rel, "number": number, "bytes": size,
                        "source_checksums": src_sums.to_json(),
                        "output_checksums": derived_sums,
                        **({"exported_checksums": exported.to_json()}
                           if exported != src_sums else {}),
                        **(conversation or {})})
    return size


def _number(job: _Job, entry: dict[str, object] | None) -> int:
    """The key's own number again; a new one for a new key or one that shares its number."""
    if not job.fmt.numbered:
        return 0
    if entry is not None and entry["number"] not in job.shared:
        return int(entry["number"])  # type: ignore[call-overload]
    job.next_number += 1
    return job.next_number - 1


def _same_file(path: Path, seen: os.stat_result) -> None:
    """Corrupt if ``path`` is no longer the file that was stat-ed before it was read."""
    now = os.stat(path)
    if _identity(now) != _identity(seen):
        raise Corrupt(f"{path} was replaced while it was read; run the export again")


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _delete_verified(src: SampleFile, src_sums: checksums.Recorded,
                     seen: os.stat_result) -> bool:
    """A skipped sample's source: read it and delete it only if its bytes are the ones
    DEST was just verified to hold."""
    bad = checksums.mismatches(src_sums, src.read_all())
    if bad:
        raise Corrupt(f"the source's {', '.join(bad)} differs from its recorded checksum; "
                      "DEST holds the recorded version, the source is kept")
    _same_file(src.path, seen)
    return _delete_if_same(src.path, seen)


def _delete_if_same(path: Path, seen: os.stat_result) -> bool:
    """Remove ``path`` only if it is still the file whose bytes were exported.

    The file is first renamed aside, so what is checked is what is removed: a newer file the
    farm renamed into place meanwhile is put back (never over a yet newer one).
    """
    aside = path.with_name(f".{path.name}.hsfarm-deleting")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if _identity(os.stat(aside)) == _identity(seen):
        durable.remove(aside)
        return True
    with contextlib.suppress(FileExistsError):  # an even newer one is there: this is stale
        os.link(aside, path)
    durable.remove(aside)
    return False
