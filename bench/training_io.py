"""Training-side I/O benchmark: export vs copy + fsync + read-back, loader vs raw reads.

For each ``--tokens`` size (default 1,500 and 8,192 tokens at H = 7168: 86 MB and 470 MB
samples), writes about ``--bytes-per-size`` of real output files (the farm's own
``OutputStore.write``: checksums, fsync, rename), then measures, alternating the two sides of
each pair ``--rounds`` times, with every source file's pages dropped from the page cache
before each pass:

- export (``training.export.runner.export``, ``--jobs``) bytes/s vs the same work its guarantee
  needs done plainly on the same files: ``cp``, fsync, drop the copy's pages, read it back
  (one copy before each export, the formats taking turns, every format against the median
  of all the size's copies);
- the loader (``training.loader.HiddenStates``, every tensor copied into a buffer, as a
  pinned-memory stage would) samples/s vs reading each file whole into a buffer.

    python bench/training_io.py --work-dir /tmp/bench --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sglang_patch import contracts as c
from training import checksums, index
from training.durable import drop_cache
from training.export.runner import export
from training.loader import HiddenStates
from worker import tensorfile
from worker.final_norm import FinalNorm, write_final_norm
from worker.finalfile import Part
from worker.store import M_CONTENT, OutputStore


def make_output(out: Path, samples: int, tokens: int, hidden: int) -> int:
    """Write ``samples`` final files; returns their total bytes."""
    fp = c.Fingerprint(config_sha256="bench", tokenizer_sha256="bench",
                       chat_template_sha256="bench", layers_to_capture=(2, 30, 58),
                       layer_convention=c.LAYER_CONVENTION, hidden_size=hidden,
                       dtype="bfloat16", max_tokens=8192, overlong="reject")
    store = OutputStore(out, fp).open()
    rng = np.random.default_rng(0)
    for i in range(samples):
        t = {c.T_INPUT_IDS: Part.from_array("I64", rng.integers(0, 160000, tokens)),
             c.T_LOSS_MASK: Part.from_array("I64", np.ones(tokens, np.int64)),
             c.T_HIDDEN: Part.from_array("BF16", rng.integers(0, 0x3F00, (tokens, hidden),
                                                              dtype=np.uint16)),
             c.T_AUX: Part.from_array("BF16", rng.integers(0, 0x3F00, (tokens, 3 * hidden),
                                                           dtype=np.uint16))}
        store.write(f"s{i:04d}", t, {M_CONTENT: "bench"})
    return sum(p.stat().st_size for p in index.sample_files(out))


def cold(out: Path) -> None:
    for p in index.sample_files(out):
        drop_cache(p)


def copy_fsync_readback(out: Path, dest: Path) -> None:
    """Per file: copy, fsync, drop the copy's pages, read it back from the disk."""
    dest.mkdir(parents=True)
    buf = bytearray(4 << 20)
    for p in index.sample_files(out):
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
    for p in index.sample_files(out):
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
    return len(ds)


def timed(fn: Callable[[], object], out: Path) -> float:
    cold(out)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", type=Path, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1500, 8192])
    ap.add_argument("--bytes-per-size", type=float, default=1e9,
                    help="about this much of samples per size (at least 2 samples)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--formats", default="specforge,modelopt,speculators")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    res: dict[str, object] = {"machine": f"{platform.node()} {os.cpu_count()} cpus",
                              "date": time.strftime("%Y-%m-%d"), "hidden": a.hidden,
                              "sizes": [bench_size(a, t) for t in a.tokens]}
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    shutil.rmtree(a.work_dir, ignore_errors=True)
    return 0


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
    write_final_norm(out, norm, checksums.as_metadata({"weight": checksums.of(norm.weight.array)}))
    # One baseline for every format: a copy before each export, the formats taking turns
    # within each round, so no format's ratio rests on copies made in one stretch of this
    # virtual disk's moods (they moved ±40% between stretches of one run).
    formats = a.formats.split(",")
    copies: list[float] = []
    exports: dict[str, list[float]] = {fmt: [] for fmt in formats}
    for r in range(a.rounds):
        for fmt in formats[r % len(formats):] + formats[: r % len(formats)]:
            dest = a.work_dir / f"copy{r}{fmt}"
            copies.append(timed(partial(copy_fsync_readback, out, dest), out))
            shutil.rmtree(dest)
            dest = a.work_dir / f"{fmt}{r}"
            exports[fmt].append(timed(partial(export, out, fmt, dest, jobs=a.jobs), out))
            shutil.rmtree(dest)
    c_s = statistics.median(copies)
    res["copy_fsync_readback_MBps"] = total / c_s / 1e6
    res["copy_fsync_readback_MBps_range"] = [total / max(copies) / 1e6, total / min(copies) / 1e6]
    print("copy + fsync + read-back", res["copy_fsync_readback_MBps"],
          res["copy_fsync_readback_MBps_range"], flush=True)
    for fmt in formats:
        e_s = statistics.median(exports[fmt])
        res[f"export_{fmt}"] = {"export_MBps": total / e_s / 1e6, "ratio": c_s / e_s,
                                "ratio_range": [min(copies) / max(exports[fmt]),
                                                max(copies) / min(exports[fmt])]}
        print(fmt, res[f"export_{fmt}"], flush=True)
    index.refresh(out)  # the loader's order and lengths come from the index
    ds, lazy = HiddenStates(out, "hsfarm"), HiddenStates(out, "hsfarm", lazy=True)
    buf = torch.empty(max(p.stat().st_size for p in index.sample_files(out)), dtype=torch.uint8)
    raws, loads, lazies = [], [], []
    for _ in range(a.rounds):
        raws.append(timed(partial(raw_reads, out, buf), out))
        loads.append(timed(partial(loader_reads, ds, buf), out))
        lazies.append(timed(partial(loader_reads, lazy, buf), out))
    r_s, l_s, z_s = (statistics.median(x) for x in (raws, loads, lazies))
    res["loader"] = {"raw_samples_per_s": samples / r_s,
                     "loader_samples_per_s": samples / l_s, "ratio": r_s / l_s,
                     "lazy_samples_per_s": samples / z_s, "lazy_ratio": r_s / z_s}
    print("loader", res["loader"], flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
