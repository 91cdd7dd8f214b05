"""Training-side I/O benchmark: export vs copy + fsync + read-back, loader vs raw reads.

    python bench/training_io.py --work-dir /tmp/bench --json out.json

Real output files (86 MB and 470 MB samples) are exported, each export paired with ``cp`` +
fsync + read-back of the same files, and loaded, paired with whole-file reads; every pass from
a cold page cache. The side that runs first alternates (a pass right after another runs
slower); the figure is the geometric mean of both orders' median ratios (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS, T_LOSS_MASK
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from training import index, roots
from training.export.runner import DEFAULT_JOBS, export
from training.loader import HiddenStates
from worker.core import checksums, tensorfile
from worker.core.diskio import drop_cache
from worker.core.final_norm import FinalNorm, write_final_norm
from worker.core.finalbytes import Part
from worker.core.finalfile import M_CONTENT
from worker.core.store import OutputStore


def make_output(out: Path, samples: int, tokens: int, hidden: int) -> int:
    """Write ``samples`` final files; returns their total bytes."""
    fp = Fingerprint(config_sha256="bench", tokenizer_sha256="bench",
                     chat_template_sha256="bench", layers_to_capture=(2, 30, 58),
                     layer_convention=LAYER_CONVENTION, hidden_size=hidden,
                     dtype="bfloat16", max_tokens=8192, overlong="reject")
    store = OutputStore(out, fp).open()
    rng = np.random.default_rng(0)
    for i in range(samples):
        t = {T_INPUT_IDS: Part.from_array("I64", rng.integers(0, 160000, tokens)),
             T_LOSS_MASK: Part.from_array("I64", np.ones(tokens, np.int64)),
             T_HIDDEN: Part.from_array("BF16", rng.integers(0, 0x3F00, (tokens, hidden),
                                                            dtype=np.uint16)),
             T_AUX: Part.from_array("BF16", rng.integers(0, 0x3F00, (tokens, 3 * hidden),
                                                         dtype=np.uint16))}
        store.write(f"s{i:04d}", t, {M_CONTENT: "bench"})
    return sum(p.stat().st_size for p in roots.sample_files(out))


def cold(out: Path) -> None:
    for p in roots.sample_files(out):
        drop_cache(p)


def copy_fsync_readback(out: Path, dest: Path) -> None:
    """Per file: copy, fsync, drop the copy's pages, read it back from the disk."""
    dest.mkdir(parents=True)
    buf = bytearray(4 << 20)
    for p in roots.sample_files(out):
        target = dest / p.name
        shutil.copyfile(p, target)
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with open(fd, "rb", buffering=0, closefd=False) as f:
                while f.readinto(buf):
                    pass
        finally:
            os.close(fd)


def raw_reads(out: Path, buf: torch.Tensor) -> int:
    """Each file read whole into one preallocated buffer (a pinned-memory stage's work)."""
    n, view = 0, memoryview(buf.numpy())
    for p in roots.sample_files(out):
        with open(p, "rb", buffering=0) as f:
            f.readinto(view[: p.stat().st_size])
        n += 1
    return n


def loader_reads(ds: HiddenStates, buf: torch.Tensor) -> int:
    """Each item's tensors copied into the same preallocated buffer: every byte touched.

    The copy is numpy's memcpy, as on the raw side (torch's ``copy_`` took 1.3-1.6x longer
    here on 2 busy cores, a cost of the consumer, not of the loader).
    """
    dst = buf.numpy()
    for i in range(len(ds)):
        offset = 0
        for t in ds[i].values():
            raw = t.reshape(-1).view(torch.uint8).numpy()
            dst[offset : offset + raw.size] = raw
            offset += raw.size
    for t in threading.enumerate():  # the loader's read-ahead is its work too: timed, and
        if t.name == "hsfarm-read-ahead":  # never left to run into the next pass
            t.join()
    return len(ds)


def timed(fn: Callable[[], object], out: Path, then_remove: Path | None = None) -> float:
    """Seconds ``fn`` takes from a cold page cache, after the disk was given everything
    pending (the last pass's deletions: this file system discards freed blocks); then
    ``then_remove`` is removed, so every pass starts from the same state."""
    os.sync()
    cold(out)
    t0 = time.perf_counter()
    fn()
    s = time.perf_counter() - t0
    if then_remove is not None:
        shutil.rmtree(then_remove)
    return s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", type=Path, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1500, 8192])
    ap.add_argument("--bytes-per-size", type=float, default=1e9,
                    help="about this much of samples per size (at least 2 samples)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, nargs="+", default=sorted({1, DEFAULT_JOBS}),
                    help="export's --jobs values to measure (default: 1 and the CLI's)")
    ap.add_argument("--formats", default="specforge,modelopt,speculators")
    ap.add_argument("--no-loader", action="store_true")
    ap.add_argument("--no-export", action="store_true", help="the loader's pairs only")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    res: dict[str, object] = {"machine": f"{platform.node()} {os.cpu_count()} cpus",
                              "date": time.strftime("%Y-%m-%d %H:%M"), "hidden": a.hidden,
                              "load_before": os.getloadavg(), "argv": sys.argv[1:],
                              "sizes": [bench_size(a, t) for t in a.tokens],
                              "load_after": os.getloadavg()}
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    shutil.rmtree(a.work_dir, ignore_errors=True)
    return 0


def pair(first: Callable[[], float], second: Callable[[], float],
         swap: bool) -> tuple[float, float]:
    """Time both sides back to back, ``second`` first when ``swap``: neither side always
    gets the disk's state left by the other."""
    if swap:
        s = second()
        return first(), s
    f = first()
    return f, second()


def summary(baseline_s: list[float], ours_s: list[float], ours_first: list[bool],
            nbytes: float) -> dict[str, object]:
    """Per-pair ratios (baseline time / ours: > 1 means ours is faster): their median and
    range, and the median of each order. Which side ran second mattered on this VM (a pass
    right after another ran slower), so the figure quoted is the geometric mean of the two
    orders' medians: a factor that slows whichever side runs second cancels out of it."""
    ratios = [b / o for b, o in zip(baseline_s, ours_s, strict=True)]
    by_order = {first: [r for r, f in zip(ratios, ours_first, strict=True) if f == first]
                for first in (False, True)}
    medians = {k: statistics.median(v) for k, v in by_order.items() if v}
    return {"ratio": math.prod(medians.values()) ** (1 / len(medians)),
            "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "ratio_baseline_first": medians.get(False), "ratio_ours_first": medians.get(True),
            "ratios": ratios, "ours_first": ours_first,
            "baseline_per_s": nbytes / statistics.median(baseline_s),
            "ours_per_s": nbytes / statistics.median(ours_s),
            "baseline_s": baseline_s, "ours_s": ours_s}


def bench_size(a: argparse.Namespace, tokens: int) -> dict[str, object]:
    out = a.work_dir / "out"
    shutil.rmtree(a.work_dir, ignore_errors=True)
    sample_bytes = tokens * (16 + 2 * 4 * a.hidden)
    samples = max(2, round(a.bytes_per_size / sample_bytes))
    total = make_output(out, samples, tokens, a.hidden)
    res: dict[str, object] = {"samples": samples, "bytes": total, "tokens": tokens,
                              "sample_MB": total / samples / 1e6}
    print(f"{samples} samples of {tokens} tokens ({total / samples / 1e6:.0f} MB)", flush=True)
    norm = FinalNorm("model.norm.weight", tensorfile.Tensor("F32", np.ones(a.hidden, np.float32)),
                     1e-6, "bench")
    sums = {"weight": checksums.of(norm.weight.array)}
    write_final_norm(out, norm, checksums.checksum_metadata(sums))
    # Every export is paired with its own copy, made right before or right after it (in
    # turn), and judged by that pair's ratio: single passes of the same copy on this virtual
    # disk moved 2-3x between stretches of one run, so only neighbours compare.
    formats = a.formats.split(",")
    runs = [] if a.no_export else [(fmt, jobs) for fmt in formats for jobs in a.jobs]
    copies: dict[str, list[float]] = {f"{f} jobs {j}": [] for f, j in runs}
    exports: dict[str, list[float]] = {f"{f} jobs {j}": [] for f, j in runs}
    swapped: dict[str, list[bool]] = {f"{f} jobs {j}": [] for f, j in runs}
    for r in range(a.rounds if runs else 0):
        for fmt, jobs in runs[r % len(runs):] + runs[: r % len(runs)]:
            name = f"{fmt} jobs {jobs}"
            swap = (r + runs.index((fmt, jobs))) % 2 == 1  # export first every other round
            dest, cdest = a.work_dir / f"{fmt}{r}", a.work_dir / f"copy{r}{fmt}"
            c_s, e_s = pair(partial(timed, partial(copy_fsync_readback, out, cdest), out, cdest),
                            partial(timed, partial(export, out, fmt, dest, jobs=jobs), out, dest),
                            swap)
            copies[name].append(c_s)
            exports[name].append(e_s)
            swapped[name].append(swap)
            print(f"  {name}: {'export' if swap else 'copy'} first: copy "
                  f"{total / c_s / 1e6:.0f} MB/s, export {total / e_s / 1e6:.0f} MB/s, "
                  f"ratio {c_s / e_s:.2f}", flush=True)
    for name in exports:
        res[f"export {name}"] = s = summary(copies[name], exports[name], swapped[name],
                                            total / 1e6)
        print(f"export {name}: ratio {s['ratio']:.2f} {s['ratio_range']}", flush=True)
    if not a.no_loader:
        res["loader"] = bench_loader(a, out, samples)
    return res


def bench_loader(a: argparse.Namespace, out: Path, samples: int) -> dict[str, object]:
    """The loader against one ``readinto`` per file, each pass paired with a raw pass made
    right before or after it (in turn)."""
    index.refresh(out)  # the loader's order and lengths come from the index
    ds, lazy = HiddenStates(out, "hsfarm"), HiddenStates(out, "hsfarm", lazy=True)
    buf = torch.empty(max(p.stat().st_size for p in roots.sample_files(out)), dtype=torch.uint8)
    raw = partial(timed, partial(raw_reads, out, buf), out)
    res: dict[str, object] = {}
    for name, loader in (("eager", ds), ("lazy", lazy)):
        raws, loads = [], []
        order = [r % 2 == 1 for r in range(a.rounds * 2)]
        for swap in order:
            r_s, l_s = pair(raw, partial(timed, partial(loader_reads, loader, buf), out), swap)
            raws.append(r_s)
            loads.append(l_s)
        res[name] = s = summary(raws, loads, order, samples)
        print(f"loader {name}: {s['ours_per_s']:.2f} vs raw {s['baseline_per_s']:.2f} "
              f"samples/s, ratio {s['ratio']:.2f} {s['ratio_range']}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
