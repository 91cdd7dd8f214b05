"""The index beside the manifest: one row per sample, refreshed incrementally.

``<out>/index.jsonl`` (its fields: docs/output.md) lets trainers bucket, split and start
without opening a sample file. ``token_counts.safetensors`` names the index it matches
(``index_sha256``), so a crash between the two writes is noticed and the counts recounted.
A refresh reads a few KB of each file not yet indexed (a changed size or mtime counts as new)
and only ``stat``-s the rest; ``verify=True`` also hashes the hidden states.
Test: tests/farm/test_training.py::test_index_refresh_with_nothing_new_reads_no_tensor_data.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine_dump.dumpfile import T_INPUT_IDS, T_LOSS_MASK
from training import roots, vocab
from training.manifest import RunInfo, load_run_info
from training.sample_file import SampleFile
from worker.core import checksums, durable, outdir, tensorfile
from worker.core.errors import Corrupt
from worker.core.finalfile import M_SOURCE_ID, M_TRUNCATED

_DIGEST = "index_sha256"


@dataclass
class RefreshReport:
    """What one refresh did."""

    rows: int = 0
    new: int = 0
    unchanged: int = 0
    removed: int = 0
    tensor_bytes_read: int = 0
    recounted: bool = False
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    doubles: list[str] = field(default_factory=list)  # samples in two roots: which was kept

    def lines(self, show: int = 20) -> list[str]:
        out = [f"indexed: {self.rows} samples ({self.new} new, {self.unchanged} unchanged, "
               f"{self.removed} removed)", f"tensor bytes read: {self.tensor_bytes_read}",
               f"rejected: {len(self.rejected)}"]
        out += [f"  rejected {p}: {why}" for p, why in self.rejected[:show]]
        return out + self.doubles


def read_rows(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The index's rows by key ({} when there is no index yet)."""
    path = out_dir / outdir.INDEX_JSONL
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {r["key"]: r for r in rows}


def read_counts(out_dir: Path) -> np.ndarray:
    """The token counts matching the current index. Raises FileNotFoundError or Corrupt."""
    tf = tensorfile.read(out_dir / outdir.TOKEN_COUNTS)
    if tf.metadata.get(_DIGEST) != _sha256(out_dir / outdir.INDEX_JSONL):
        raise Corrupt(f"{out_dir / outdir.TOKEN_COUNTS} does not match {outdir.INDEX_JSONL}: "
                      "run the index refresh")
    return tf.tensors["counts"].array


def refresh(out_dir: Path, verify: bool = False,
            progress: Callable[[int], None] | None = None,
            also: Sequence[Path] = ()) -> RefreshReport:
    """Index the files not yet indexed; drop rows whose file is gone. Raises ConfigError.

    ``also``: more roots of this run (other hosts' output dirs, or copies of them), indexed
    into ``out_dir``'s index with paths relative to it; each sample once (``training.roots``).
    """
    info = load_run_info(out_dir)
    roots.check_same_run([out_dir, *also])
    gathered = roots.gather([out_dir, *also])
    old = read_rows(out_dir)
    try:
        counts = read_counts(out_dir) if old else np.zeros(0, np.int64)
    except (FileNotFoundError, Corrupt):
        counts = None  # recount below
    rows: dict[str, dict[str, Any]] = {}
    report = RefreshReport()
    for key, path in gathered.files.items():
        st = path.stat()
        prev = old.get(key)
        if prev and (prev["bytes"], prev["mtime_ns"], prev["path"]) == (
                st.st_size, st.st_mtime_ns, os.path.relpath(path, out_dir)):
            rows[key] = prev
            report.unchanged += 1
        else:
            counts = None if prev else counts  # a changed file: its old counts are unknown
            _index_new(info, path, key, st, verify, rows, report)
            if counts is not None and key in rows:
                counts = vocab.add_counts(counts, rows[key].pop("_counts"))
        if progress:
            progress(1)
    report.removed = len(set(old) - set(rows))
    if counts is None or report.removed:
        counts, report.recounted = _recount(out_dir, rows, report), True
    for r in rows.values():
        r.pop("_counts", None)
    _write(out_dir, rows, counts)
    report.rows, report.new = len(rows), len(rows) - report.unchanged
    report.doubles = gathered.lines()
    return report


def _index_new(info: RunInfo, path: Path, key: str, st: os.stat_result, verify: bool,
               rows: dict[str, dict[str, Any]], report: RefreshReport) -> None:
    """Check one new file and add its row (with its token counts under ``_counts``)."""
    try:
        sf = SampleFile.open(path)
        info.check_sample(sf, key)
        names = list(sf.entries) if verify else [T_INPUT_IDS, T_LOSS_MASK]
        arrays = {n: sf.read(n) for n in names}
        report.tensor_bytes_read += sum(a.nbytes for a in arrays.values())
        bad = checksums.mismatches(checksums.recorded(sf.metadata), arrays)
        if bad:
            raise Corrupt(f"checksum of {', '.join(bad)}")
    except (Corrupt, OSError) as e:
        report.rejected.append((os.path.relpath(path, info.out_dir), str(e)))
        return
    ids, mask = arrays[T_INPUT_IDS], arrays[T_LOSS_MASK]
    rows[key] = {
        "key": key, "path": os.path.relpath(path, info.out_dir), "tokens": len(ids),
        "loss_tokens": int(np.count_nonzero(mask)), "bytes": st.st_size,
        "mtime_ns": st.st_mtime_ns, "checksums": checksums.recorded(sf.metadata).to_json(),
        "source_id": _json_or_text(sf.metadata.get(M_SOURCE_ID)),
        "truncated_from": int(sf.metadata.get(M_TRUNCATED) or 0),
        "_counts": vocab.count_masked(ids, mask),
    }


def _recount(out_dir: Path, rows: dict[str, dict[str, Any]], report: RefreshReport) -> np.ndarray:
    """Token counts from scratch: the ids and masks of every indexed file."""
    counts = np.zeros(0, np.int64)
    for r in rows.values():
        if "_counts" in r:
            more = r["_counts"]
        else:
            sf = SampleFile.open(out_dir / r["path"])
            ids, mask = sf.read(T_INPUT_IDS), sf.read(T_LOSS_MASK)
            report.tensor_bytes_read += ids.nbytes + mask.nbytes
            more = vocab.count_masked(ids, mask)
        counts = vocab.add_counts(counts, more)
    return counts


def _write(out_dir: Path, rows: dict[str, dict[str, Any]], counts: np.ndarray) -> None:
    """Counts first, then the index, each temp → fsync → rename."""
    body = "".join(json.dumps(rows[k], sort_keys=True) + "\n" for k in sorted(rows)).encode()
    digest = hashlib.sha256(body).hexdigest()
    tmp = outdir.temp_path(out_dir / outdir.TOKEN_COUNTS)
    tensorfile.write(tmp, {"counts": tensorfile.Tensor("I64", counts.astype(np.int64))},
                     {_DIGEST: digest})
    durable.commit(tmp, out_dir / outdir.TOKEN_COUNTS)
    tmp = outdir.temp_path(out_dir / outdir.INDEX_JSONL)
    tmp.write_bytes(body)
    durable.commit(tmp, out_dir / outdir.INDEX_JSONL)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def _json_or_text(value: str | None) -> object:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError:
        return value
