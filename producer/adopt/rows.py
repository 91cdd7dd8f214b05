"""Every matched file's first rows against the live server: ``adopt``'s per-file check.

The K-file check misses a foreign minority with probability C(n-f, K) / C(n, K), so every
file's first ``PREFIX_TOKENS`` tokens are sent (``BATCH`` files at once) and its states at
``ROWS`` of them compared with the dump's. Causal attention makes the prefix's rows the whole
file's rows, and another model, layer set or norm differs at every row, so each such file is
refused on its own. A file edited only after its first rows is left to the checksums.
Test: tests/farm/test_adopt_checks.py::test_a_foreign_minority_is_caught_file_by_file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine_dump import contracts as c
from producer.adopt import check as ck
from producer.adopt.formats import SourceSample
from worker.core import canary as cn
from worker.core.errors import SourceFileRefused
from worker.core.settings import Settings

PREFIX_TOKENS = 32  # tokens sent per file: a prefill this short costs little next to a sample
ROWS = 8  # rows of the prefix compared per file (its first and last included)
BATCH = 64  # files sent to the server at once


@dataclass
class RowsResult:
    """What the per-file check found: files checked, and those refused with the reason."""

    checked: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    worst_max_rel: float = 0.0  # the worst row error among the files that passed

    def refused_names(self) -> set[str]:
        return {name for name, _ in self.refused}


def prefix_rows(n_tokens: int) -> np.ndarray:
    """The rows compared: ``ROWS`` evenly spaced over the first ``PREFIX_TOKENS`` tokens."""
    n = min(n_tokens, PREFIX_TOKENS)
    return np.unique(np.linspace(0, n - 1, min(ROWS, n)).round().astype(np.int64))


def picked_of(name: str, s: SourceSample) -> ck.Picked:
    """A file's prefix ids and its states at ``prefix_rows`` (read from the source's mapping:
    a few rows, not the file)."""
    rows = prefix_rows(len(s.input_ids))
    n = int(rows[-1]) + 1
    return ck.Picked(name, s.input_ids[:n].tolist(), rows, ck.states_at(s.hidden, s.aux, rows))


def check_files(settings: Settings, run_id: str, fingerprint: c.Fingerprint,
                files: list[tuple[str, Path]], load: Callable[[Path], SourceSample],
                tick: Callable[[], None] | None = None) -> RowsResult:
    """Compare every file of ``files`` (name, path) at its prefix rows with the server.

    Raises:
        ServerUnavailable, Transient, Corrupt: the server could not answer for a file.
    """
    out = RowsResult()
    names = cn.layer_names(fingerprint.layers_to_capture)
    for start in range(0, len(files), BATCH):
        picked = []
        for name, path in files[start:start + BATCH]:
            try:
                picked.append(picked_of(name, load(path)))
            except SourceFileRefused as e:
                out.refused.append((name, str(e)))
        for p, new in zip(picked, ck.extract_again(settings, run_id, picked), strict=True):
            cmp = cn.compare([cn.Canary(np.asarray(p.input_ids), p.rows, p.states)], [new],
                             names, settings.canary_max_rel_err, settings.canary_mean_rel_err)
            out.checked += 1
            if cmp.passed:
                out.worst_max_rel = max([out.worst_max_rel, *(e.max_rel for e in cmp.layers)])
            else:
                out.refused.append((p.name, _why(cmp, len(p.rows))))
            if tick is not None:
                tick()
    return out


def _why(cmp: cn.Comparison, rows: int) -> str:
    bad = [e.name for e in cmp.layers
           if e.max_rel > cmp.max_rel_tol or e.mean_rel > cmp.mean_rel_tol]
    return (f"its states at {rows} rows of its first {PREFIX_TOKENS} tokens are not the "
            f"server's ({', '.join(bad)} differ; {cmp.summary()}; tolerance max "
            f"{cmp.max_rel_tol:.2%}): written by another model, checkpoint or layer set")


def miss_probability(n: int, foreign: int, k: int) -> float:
    """The chance that ``k`` files drawn of ``n`` include none of ``foreign`` ones."""
    if foreign <= 0:
        return 1.0
    p = 1.0
    for i in range(min(k, n)):
        p *= max(0, n - foreign - i) / (n - i)
    return p


def guarantee(n_files: int, k: int) -> list[str]:
    """What the checks guarantee for a foreign minority among ``n_files``, in words."""
    one = max(1, round(n_files / 100))
    return [
        "detection guarantee: every file whose states another model, checkpoint or layer set "
        f"wrote is refused on its own by the per-file check ({ROWS} rows of its first "
        f"{PREFIX_TOKENS} tokens, all layers, each file against the server), whatever their "
        "fraction;",
        f"  a file edited only after its first {PREFIX_TOKENS} tokens is caught by its "
        f"checksums (hsfarm) or the {k} full re-extractions: {one} such file of {n_files} "
        f"escapes them with probability {miss_probability(n_files, one, k):.0%}"]
