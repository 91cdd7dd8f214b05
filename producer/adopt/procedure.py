"""``python -m producer adopt SOURCE --data DATA``: take an earlier run's files into this run.

Check the server is the run's; match each source file to the record with exactly its
``input_ids``; re-extract K files and compare every file's rows over its whole length (each
read once and pinned); write each as this run's final file under the sample's lease, with the
bytes it was checked with. Only the writes hold the run's enqueue lock. Killed anywhere, it
leaves whole or temp files; run again, it adopts the rest (docs/adopt.md).
Test: tests/farm/test_adopt.py::test_sigkill_mid_adopt_then_two_at_once."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engine_dump.dumpfile import DTYPE_FP8, M_LAYERS
from engine_dump.fingerprint import Fingerprint
from engine_dump.rids import NO_RUN
from producer.adopt import check as ck
from producer.adopt import header as ah
from producer.adopt import match as am
from producer.adopt import pin as pn
from producer.adopt import rows as ar
from producer.adopt.canary import canary_outcome, served_check
from producer.adopt.formats import detect, list_files, open_sample
from producer.adopt.write import write_adopted
from worker.core import finalfile, outdir, tensorfile
from worker.core import manifest as manifests
from worker.core import store as st
from worker.core.errors import BadInput, ConfigError, Corrupt, SourceFileRefused, StaleRecord
from worker.core.finalfile import M_ADOPTED_CHECK, M_ADOPTED_FORMAT, M_ADOPTED_FROM, M_WEIGHTS_ID
from worker.core.samples import SampleRef, read_sample
from worker.core.settings import Settings
from worker.server.canary_check import Outcome
from worker.server.chat import ChatTokenizer
from worker.state import broker
from worker.state import lease as leases
from worker.state.enqueue import open_run, run_lock_name
from worker.state.index import RunIndex

# a Hugging Face fast tokenizer is not safe to call from two threads at once (--jobs)
_ENCODE = threading.Lock()


@dataclass(frozen=True)
class Run:
    """What adopting needs of the run: settings, tokenizer, fingerprint, model path."""

    settings: Settings
    chat: ChatTokenizer
    fingerprint: Fingerprint
    model_path: Path


@dataclass
class Report:
    """What one adopt did, counted in one unit per count: ``files`` read from SOURCE (each
    ends in exactly one of ``file_counts``' outcomes), samples adopted and already done (a file
    of records with the same ids serves each of them), refused files with their reasons."""

    files: int = 0
    adopted: int = 0  # samples written
    done: int = 0  # samples whose final file already held their record
    busy: list[tuple[str, str]] = field(default_factory=list)  # (file, holder)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (file, its first copy)
    adopted_files: set[str] = field(default_factory=set)
    done_files: set[str] = field(default_factory=set)
    would_files: set[str] = field(default_factory=set)  # a dry run's
    mask_differs: int = 0
    unmatched: int = 0
    records: int = 0
    check: ck.CheckResult | None = None
    canary: Outcome | None = None  # the run's canary, when one was recorded
    served: str = ""  # what the probe of the server's identity found
    headers_checked: int = 0  # hsfarm files whose own header was compared with the run
    rows: ar.RowsResult | None = None  # the per-file check of every matched file
    dry_run: bool = False
    would_adopt: int = 0

    @property
    def ok(self) -> bool:
        return not self.refused and self.compatible

    @property
    def compatible(self) -> bool:
        """Neither the canary nor the compatibility check failed."""
        return ((self.canary is None or self.canary.passed)
                and (self.check is None or self.check.passed))

    def _checked(self) -> list[str]:
        """What was checked, per run and per file, and what that guarantees."""
        if not self.served:
            return []
        out = [f"checked per run: served identity (weights, layers, config, dtype): "
               f"{self.served}"]
        if self.canary is not None:
            out.append("checked per run: the run's canary")
        if self.check is not None:
            out.append(f"checked per run: {len(self.check.files)} files extracted again whole")
        per_file = [f"ids and shapes of all {self.files}"]
        if self.headers_checked:
            per_file.append(f"own header (layers, fingerprint id, weights identity, dtype) of "
                            f"{self.headers_checked}")
        if self.rows is not None:
            per_file.append(f"states at the first, the last and {ar.ROWS} random rows over "
                            f"the whole length of all {self.rows.checked} matched, against the "
                            f"server ({len(self.rows.refused)} differ)")
        out.append(f"checked per file: {'; '.join(per_file)}")
        if self.rows is not None:
            out += ar.guarantee()
        return out

    def lines(self) -> list[str]:
        out = [f"  {name}: {why}" for name, why in self.refused]
        out += [f"  {name}: being extracted by a worker ({who}); left to it"
                for name, who in self.busy]
        if self.canary is not None:
            out.append(self.canary.text if self.canary.passed else
                       "the server fails the run's canary, so it cannot judge the files; "
                       f"nothing adopted:\n{self.canary.text}")
        if self.check is not None:
            out += self.check.lines()
        out += self._checked()
        if self.unmatched and not self.done and self.check is None:
            out.append("no file matches a record: the source was tokenized otherwise (another "
                       "chat template, tokenizer or FARM_MAX_TOKENS) or holds another data "
                       "file's samples")
        if self.mask_differs:
            out.append(f"loss mask differs from this run's in {self.mask_differs} files: "
                       "this run's mask was written")
        verb = "would adopt" if self.dry_run else "adopted"
        n = self.would_adopt if self.dry_run else self.adopted
        per_file = ", ".join(f"{k} {v}" for k, v in self.file_counts().items())
        out += [f"files: {self.files} read ({per_file})", f"{verb}: {_n(n, 'sample')}",
                f"already done: {_n(self.done, 'sample')}",
                f"refused: {_n(self.refused_files(), 'file')}"]
        if self.busy:
            out.append(f"left to workers: {_n(len(self.busy), 'file')}")
        if not self.dry_run and not n and not self.refused and not self.busy and self.done:
            out.append("nothing to adopt: this run already holds every sample these files "
                       "hold")
        return out

    def refused_files(self) -> int:
        return len({name for name, _ in self.refused})

    def file_counts(self) -> dict[str, int]:
        """Each file read, once, by what became of it; the counts sum to ``files``. A file
        refused for one of its samples counts as refused; the others' outcomes follow."""
        refused = {name for name, _ in self.refused}
        busy = {name for name, _ in self.busy} - refused
        adopted = (self.would_files if self.dry_run else self.adopted_files) - refused - busy
        done = self.done_files - refused - busy - adopted
        copies = {name for name, _ in self.duplicates} - refused - busy - adopted - done
        counts = {"would adopt" if self.dry_run else "adopted": len(adopted),
                  "already done": len(done), "copies of another file": len(copies),
                  "refused": len(refused)}
        if busy:
            counts["left to workers"] = len(busy)
        left = self.files - sum(counts.values())
        if left:  # the run's check refused them all before any was written
            counts["not adopted (the check above failed)"] = left
        return counts


def _n(count: int, unit: str) -> str:
    return f"{count} {unit}{'s' * (count != 1)}"


def adopt(run: Run, source: Path, data: Path, *, fmt: str = "auto",
          keys: dict[str, tuple[str, ...]] | None = None, check_k: int | None = None,
          dry_run: bool = False, jobs: int = 2, progress: bool = True,
          seed: int | None = None, after_check: Callable[[], None] | None = None) -> Report:
    """Adopt ``source``'s files for the records of ``data`` (the module's steps).
    ``after_check`` runs once every check passed, before anything is written (a test swaps a
    source file there).

    Raises:
        ConfigError: an unrecognised format, a foreign output dir, an unusable setting.
        DataFileError: ``data`` cannot be read as records.
        ServerUnavailable, Transient: the check could not reach the server.
    """
    s = run.settings
    why = fp8_problem(s)
    if why:
        raise ConfigError(why)
    fmt = detect(source) if fmt == "auto" else fmt
    served = served_check(s, run.fingerprint, run.model_path)  # before a source is read
    store = st.OutputStore(s.output_dir, run.fingerprint)
    if not dry_run or (s.output_dir / outdir.MANIFEST).exists():
        store = open_run(s, run.fingerprint, run.model_path)
        store.debug_write_delay_s = s.debug_write_delay_s
    run_id = store.run_id or NO_RUN
    r = broker.client(s)
    report = Report(dry_run=dry_run, served=served)
    with _bar(progress, "tokenize", None) as bar:
        records = am.tokenize_records(data, run.chat, s.max_record_bytes, bar.update)
    files = list_files(source, fmt)
    report.files, report.records = len(files), records.count
    with _bar(progress, "match", len(files)) as bar:
        found = am.scan(files, fmt, keys, records, store, source, bar.update)
    report.refused, report.duplicates = list(found.refused), list(found.duplicates)
    report.done = len({key for _, key in found.done})
    report.done_files = {name for name, _ in found.done}
    report.unmatched = found.unmatched
    if fmt == "hsfarm":
        report.headers_checked = _screen_headers(run, store, found, source, report)
    if not found.matched:
        return report
    report.canary = canary_outcome(s, store, run.model_path, run.chat)
    if report.canary is not None and not report.canary.passed:
        return report
    report.check = _check(run, store, run_id, found, fmt, keys, check_k, seed, source)
    if not report.check.passed:
        return report
    report.rows = _check_rows(run, run_id, found, fmt, keys, source, progress, seed)
    _drop(found, source, report.rows.refused, report)
    report.would_adopt = len(found.matched)
    report.would_files = {str(path.relative_to(source)) for path, _, _ in found.matched.values()}
    if dry_run:
        return report
    if after_check is not None:
        after_check()
    # only the writing holds the lock: each sample's state is read again under its lease
    with leases.held(r, run_lock_name(run_id), s.lease_ttl_s, deadline=math.inf, poll_s=1.0):
        _adopt_all(run, store, RunIndex(r, run_id), found, fmt, keys, source, report, jobs,
                   progress, report.rows.pins)
        _record(store.out_dir, source, fmt, data, report)
    return report


def _bar(progress: bool, desc: str, total: int | None) -> tqdm:
    return tqdm(total=total, desc=desc, unit=" files" if total else " records",
                disable=not progress)


def _check(run: Run, store: st.OutputStore, run_id: str, found: am.Scan, fmt: str,
           keys: dict[str, tuple[str, ...]] | None, check_k: int | None, seed: int | None,
           source: Path) -> ck.CheckResult:
    """Pick K matched files, load each (one at a time) and compare with the server."""
    k = ck.default_k(len(found.matched)) if check_k is None else max(1, check_k)
    picked = []
    for key in ck.pick(sorted(found.matched), k, seed):
        path, _, _ = found.matched[key]
        s = open_sample(path, fmt, keys)
        picked.append(ck.picked(str(path.relative_to(source)), s, ck.rows_of(len(s.input_ids))))
    return ck.run_check(run.settings, run_id, run.fingerprint, store.out_dir, picked)


def _screen_headers(run: Run, store: st.OutputStore, found: am.Scan, source: Path,
                    report: Report) -> int:
    """Refuse the matched hsfarm files whose header names another run; how many were read."""
    refused = []
    for path, _, _ in found.matched.values():
        try:
            meta = tensorfile.header_metadata(path)
        except (Corrupt, OSError) as e:
            refused.append((str(path.relative_to(source)), f"unreadable: {e}"))
            continue
        why = ah.refusal(meta, run.fingerprint, store.weights_id)
        if why:
            refused.append((str(path.relative_to(source)), why))
    n = len(found.matched)
    _drop(found, source, refused, report)
    return n


def _check_rows(run: Run, run_id: str, found: am.Scan, fmt: str,
                keys: dict[str, tuple[str, ...]] | None, source: Path,
                progress: bool, seed: int | None) -> ar.RowsResult:
    """Every matched file's rows over its whole length against the server (``rows``); each
    file once, however many records share it."""
    files = sorted({(str(path.relative_to(source)), path, tokens)
                    for path, _, tokens in found.matched.values()})
    with _bar(progress, "check rows", len(files)) as bar:
        return ar.check_files(run.settings, run_id, run.fingerprint, files,
                              lambda p: open_sample(p, fmt, keys), bar.update, seed)


def _drop(found: am.Scan, source: Path, refused: list[tuple[str, str]],
          report: Report) -> None:
    """Take the ``refused`` files (name, reason) out of the matched ones, into the report."""
    names = {name for name, _ in refused}
    for key, (path, _, _) in list(found.matched.items()):
        if str(path.relative_to(source)) in names:
            del found.matched[key]
    report.refused += refused


def _adopt_all(run: Run, store: st.OutputStore, index: RunIndex, found: am.Scan, fmt: str,
               keys: dict[str, tuple[str, ...]] | None, source: Path, report: Report,
               jobs: int, progress: bool, pins: dict[str, pn.Pin]) -> None:
    assert report.check is not None
    check = json.dumps({"files": len(report.check.files),
                        "worst_max_rel": max((e.max_rel for e in report.check.comparison.layers),
                                             default=0.0)})
    items = sorted(found.matched.items())

    def one(item: tuple[str, tuple[Path, SampleRef, int]]) -> tuple[str, str, str]:
        _, (path, ref, _) = item
        name = str(path.relative_to(source))
        try:
            if name not in pins:
                raise SourceFileRefused("not checked against the server: not adopted")
            return name, *_adopt_one(run, store, index, path, ref, fmt, keys, check,
                                     pins[name])
        except SourceFileRefused as e:
            return name, "refused", str(e)
        except leases.LeaseLost:  # an attempt took the sample while it was written
            return name, "busy", "an attempt that took its lease while it was written"

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool, \
            _bar(progress, "adopt", len(items)) as bar:
        for name, outcome, why in pool.map(one, items):
            bar.update()
            if outcome == "adopted":
                report.adopted += 1
                report.adopted_files.add(name)
                report.mask_differs += why == "mask differs"
            elif outcome == "done":
                report.done += 1
                report.done_files.add(name)
            elif outcome == "busy":
                report.busy.append((name, why))
            else:
                report.refused.append((name, why))


def _adopt_one(run: Run, store: st.OutputStore, index: RunIndex, path: Path, ref: SampleRef,
               fmt: str, keys: dict[str, tuple[str, ...]] | None, check: str, pin: pn.Pin
               ) -> tuple[str, str]:
    """(outcome, detail): ("adopted", "" | "mask differs"), ("done", ""), ("busy", holder).

    Raises:
        SourceFileRefused: the file (or its record) cannot be adopted; the reason.
        NoSpace, OutputUnavailable: the output disk failed (the command stops).
    """
    got = index.try_sample_lease(ref.key, run.settings.lease_ttl_s)
    if isinstance(got, str):
        return "busy", got
    try:
        state = am.done_state(store, ref)
        if state == "done":
            return "done", ""
        if state is not None:
            raise SourceFileRefused(state)
        return _write(run, store, index, path, ref, fmt, keys, check, got, pin)
    finally:
        got.release()


def _write(run: Run, store: st.OutputStore, index: RunIndex, path: Path, ref: SampleRef,
           fmt: str, keys: dict[str, tuple[str, ...]] | None, check: str,
           lease: leases.Lease, pin: pn.Pin) -> tuple[str, str]:
    try:
        sample, _ = read_sample(ref)
        with _ENCODE:
            tok = run.chat.encode(sample)
    except (BadInput, StaleRecord) as e:
        raise SourceFileRefused(f"its record {ref.index} changed: {e}") from e
    s = open_sample(path, fmt, keys)
    if why := pin.problem(s):  # another file than the one checked: not even its ids count
        raise SourceFileRefused(why)
    if not np.array_equal(s.input_ids, np.asarray(tok.input_ids, dtype=np.int64)):
        raise SourceFileRefused(f"its record {ref.index} changed since it was matched")
    mask = np.asarray(tok.loss_mask, dtype=np.int64)
    differs = s.loss_mask is not None and not np.array_equal(s.loss_mask, mask)
    meta = {finalfile.M_SOURCE_ID: json.dumps(sample.source_id), finalfile.M_SOURCE_FILE: ref.file,
            finalfile.M_TRUNCATED: str(tok.truncated_from),
            M_LAYERS: json.dumps(list(run.fingerprint.layers_to_capture)),
            M_WEIGHTS_ID: store.weights_id, M_ADOPTED_FROM: str(path.resolve()),
            M_ADOPTED_FORMAT: fmt, M_ADOPTED_CHECK: check}
    v = write_adopted(store, ref.key, ref.sha256, s, mask, meta, before_write=lease.check,
                      pin=pin)
    index.mark_done(ref.key, v.size_bytes, v.tokens)
    return "adopted", "mask differs" if differs else ""


def fp8_problem(settings: Settings) -> str | None:
    """Why states cannot be quantized for this run here, or None (a bf16 run; torch there)."""
    if settings.hidden_dtype != DTYPE_FP8:
        return None
    try:
        from engine_dump import fp8  # noqa: F401  (torch, as the hook quantizes)
    except ImportError as e:
        return (f"this run stores {DTYPE_FP8} (FARM_STORE_DTYPE); adopt quantizes with the "
                f"hook's code, which needs torch ({e}): pip install 'hsfarm[training]'")
    return None


def _record(out_dir: Path, source: Path, fmt: str, data: Path, report: Report) -> None:
    """Add this adoption to the manifest (temp file, fsync, rename, fsync dir). The run id
    does not depend on this entry (worker/core/run.py); the enqueue lock is held."""
    manifests.append(out_dir, manifests.M_ADOPTIONS, {
        "at": time.time(), "source": str(source.resolve()), "format": fmt,
        "data": str(data.resolve()), "adopted": report.adopted, "already_done": report.done,
        "refused": report.refused_files(), "copies": len(report.duplicates),
        "mask_differs": report.mask_differs,
        "check": report.check.to_json() if report.check else None})
