"""Every matched file's rows, over its whole length, against the live server: ``adopt``'s
per-file check."""

# The K-file check misses a foreign minority with probability C(n-f, K) / C(n, K), so every file
# is sent whole (``BATCH`` files, at most ``BATCH_TOKENS`` tokens, at once) and its states at its
# first and last rows and ``ROWS`` rows drawn at random among the others are compared with the
# dump's, all layers. Another model, layer set or norm differs at every row; damage confined to
# some rows (a tail another checkpoint wrote, rows shifted by one) is caught when a drawn row
# holds it: a file with a fraction f of its rows off escapes with probability at most
# (1 - f) ** ROWS (``escape_probability``), and a damaged tail never escapes (the last row is
# always compared). The rows are drawn whatever the file holds (from ``--seed`` when given).
# Each file is read once here and pinned (``pin``): it is written as it was compared, or not.
# Tests: tests/farm/test_adopt_checks.py::test_a_foreign_minority_is_caught_file_by_file,
# tests/farm/test_adopt_checks.py::test_a_file_damaged_after_its_first_rows_is_refused.

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine_dump.fingerprint import Fingerprint
from producer.adopt import check as ck
from producer.adopt import pin as pn
from producer.adopt.formats import SourceSample
from worker.core import canary as cn
from worker.core.errors import SourceFileRefused
from worker.core.settings import Settings

ROWS = 48  # rows drawn per file besides its first and last: see escape_probability
BATCH = 64  # files sent to the server at once
BATCH_TOKENS = 32768  # tokens sent at once (their dumps wait on the dump dir's tmpfs)
BOUND_FRACTIONS = (0.05, 0.10, 0.25)  # damaged fractions the report states the bound for


@dataclass
class RowsResult:
    """What the per-file check found: files checked, those refused with the reason, and the
    pin of each file that passed (by name)."""

    checked: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    worst_max_rel: float = 0.0  # the worst row error among the files that passed
    pins: dict[str, pn.Pin] = field(default_factory=dict)

    def refused_names(self) -> set[str]:
        return {name for name, _ in self.refused}


def file_rows(n_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """The rows compared: the first, the last, and ``ROWS`` of the others drawn uniformly
    without replacement (all of them when there are fewer)."""
    inner = np.arange(1, n_tokens - 1, dtype=np.int64)
    if len(inner) > ROWS:
        inner = rng.choice(inner, ROWS, replace=False)
    return np.unique(np.concatenate([[0, n_tokens - 1], inner]).astype(np.int64))


def picked_of(name: str, s: SourceSample, rng: np.random.Generator
              ) -> tuple[ck.Picked, pn.Pin]:
    """A file's ids and its states at ``file_rows``, and its pin: one read of the file."""
    rows = file_rows(len(s.input_ids), rng)
    pin, at = pn.take(s, rows)
    return ck.picked_of_rows(name, s.input_ids.tolist(), rows, at), pin


def batches(sizes: list[int]) -> Iterator[range]:
    """Consecutive ranges of ``sizes`` (tokens per file): at most ``BATCH`` files and
    ``BATCH_TOKENS`` tokens each, or one longer file alone."""
    start, tokens = 0, 0
    for i, n in enumerate(sizes):
        if i > start and (i - start >= BATCH or tokens + n > BATCH_TOKENS):
            yield range(start, i)
            start, tokens = i, 0
        tokens += n
    if start < len(sizes):
        yield range(start, len(sizes))


def check_files(settings: Settings, run_id: str, fingerprint: Fingerprint,
                files: list[tuple[str, Path, int]], load: Callable[[Path], SourceSample],
                tick: Callable[[], None] | None = None, seed: int | None = None) -> RowsResult:
    """Compare every file of ``files`` (name, path, tokens) at its ``file_rows`` with the server.

    Raises:
        ServerUnavailable, Transient, Corrupt: the server could not answer for a file.
    """
    out = RowsResult()
    rng = np.random.default_rng(seed)
    for batch in batches([n for _, _, n in files]):
        picked = []
        for name, path, _ in (files[i] for i in batch):
            try:
                p, pin = picked_of(name, load(path), rng)
            except SourceFileRefused as e:
                out.refused.append((name, str(e)))
                continue
            picked.append(p)
            out.pins[name] = pin
        for p, new in zip(picked, ck.extract_again(settings, run_id, picked), strict=True):
            _judge(out, p, new, fingerprint, settings)
            if tick is not None:
                tick()
    return out


def _judge(out: RowsResult, p: ck.Picked, new: np.ndarray, fingerprint: Fingerprint,
           settings: Settings) -> None:
    names = cn.layer_names(fingerprint.layers_to_capture)
    cmp = cn.compare([p.recorded(new)], [new], names, settings.canary_max_rel_err,
                     settings.canary_mean_rel_err)
    out.checked += 1
    if cmp.passed:
        out.worst_max_rel = max([out.worst_max_rel, *(e.max_rel for e in cmp.layers)])
    else:
        out.refused.append((p.name, _why(cmp, p)))
        del out.pins[p.name]


def _why(cmp: cn.Comparison, p: ck.Picked) -> str:
    bad = [e.name for e in cmp.layers
           if e.max_rel > cmp.max_rel_tol or e.mean_rel > cmp.mean_rel_tol]
    return (f"its states at {len(p.rows)} of its {len(p.input_ids)} rows are not the "
            f"server's ({', '.join(bad)} differ; {cmp.summary()}; tolerance max "
            f"{cmp.max_rel_tol:.2%}): written by another model, checkpoint or layer set, or "
            "damaged")


def escape_probability(damaged_fraction: float, rows: int = ROWS) -> float:
    """The most a file with ``damaged_fraction`` of its rows off escapes the check with:
    ``rows`` drawn without replacement all miss them, at most (1 - f) ** rows."""
    return max(0.0, 1.0 - damaged_fraction) ** rows


def miss_probability(n: int, foreign: int, k: int) -> float:
    """The chance that ``k`` files drawn of ``n`` include none of ``foreign`` ones."""
    if foreign <= 0:
        return 1.0
    p = 1.0
    for i in range(min(k, n)):
        p *= max(0, n - foreign - i) / (n - i)
    return p


def guarantee() -> list[str]:
    """What the per-file check guarantees for each file, in words."""
    bounds = ", ".join(f"{f:.0%} of its rows off: at most {escape_probability(f):.2g}"
                       for f in BOUND_FRACTIONS)
    return [
        "detection guarantee: every file whose states another model, checkpoint or layer set "
        f"wrote is refused on its own by the per-file check (its first and last rows and "
        f"{ROWS} drawn at random over its whole length, all layers, against the server), "
        "whatever their fraction; a file damaged from some row to its end is refused;",
        f"  a file with damage confined to some rows escapes with probability ({bounds}); "
        "each file is written with the bytes it was checked with, or not at all"]
