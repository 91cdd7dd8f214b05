"""What the weights identity's full hash costs: xxh3-128 over mapped shards, per core and in
parallel over shards, from the page cache and from the disk, and what the cache saves.

    PYTHONPATH=$PWD .venv/bin/python bench/weights_hash.py [--shards 4] [--shard-gib 1]

Writes synthetic shards of random bytes, then prints one line per measurement (warm: in the page
cache; cold: dropped from it, the disk's speed; the identity first and cached; the tiny model's)
and an extrapolation to 600 GB. Results: docs/canary.md ("Weights identity").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine_dump import weights_hash
from engine_dump.checkpoint import weights_identity

GB = 1e9


def write_shard(path: Path, nbytes: int) -> None:
    """A safetensors file holding one U8 tensor of ``nbytes`` random bytes."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes],
                               "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        block = os.urandom(64 << 20)
        for at in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - at)])


def drop_cache(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def hash_all(paths: list[Path], threads: int) -> float:
    """Seconds to hash every shard's data, ``threads`` at a time."""
    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda p: weights_hash.data_hash(p, 8), paths))
    return time.perf_counter() - began


def best_of(n: int, run: object) -> tuple[float, float]:
    """(fastest, median) of ``n`` runs of ``run() -> seconds``: on a shared machine the fastest
    is the least disturbed."""
    assert callable(run)
    times = sorted(run() for _ in range(n))
    return times[0], times[n // 2]


def identity_s(model: Path) -> tuple[float, float]:
    """(first call without a cache, second call with it), in seconds."""
    for p in model.glob(f"{weights_hash.CACHE_NAME}*"):
        p.unlink()
    began = time.perf_counter()
    weights_identity(model)
    first = time.perf_counter() - began
    began = time.perf_counter()
    weights_identity(model)
    return first, time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--shard-gib", type=float, default=1.0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    root = Path(tempfile.mkdtemp(prefix="hsfarm-weights-bench.", dir=args.dir))
    try:
        nbytes = int(args.shard_gib * (1 << 30))
        paths = [root / f"model-{i:05d}-of-{args.shards:05d}.safetensors"
                 for i in range(args.shards)]
        for p in paths:
            write_shard(p, nbytes)
        total = nbytes * len(paths)
        print(f"{len(paths)} shards of {nbytes / GB:.2f} GB on {cores} cores")
        weights_hash.data_hash(paths[0], 8)  # into the page cache
        one, one_med = best_of(5, lambda: hash_all(paths[:1], 1))
        print(f"warm 1 thread      {nbytes / GB / one:6.2f} GB/s (median of 5 "
              f"{nbytes / GB / one_med:.2f})")
        threads = min(len(paths), cores)
        warm, warm_med = best_of(3, lambda: hash_all(paths, threads))
        print(f"warm {threads} threads     {total / GB / warm:6.2f} GB/s (median of 3 "
              f"{total / GB / warm_med:.2f})")
        for p in paths:
            drop_cache(p)
        cold = hash_all(paths, threads)
        print(f"cold {threads} threads     {total / GB / cold:6.2f} GB/s (the disk)")
        first, cached = identity_s(root)
        print(f"identity first     {first:6.2f} s, cached {cached * 1e3:.1f} ms")
        from sglang_patch.tiny_model import ensure_tiny_model

        tiny = ensure_tiny_model(Path.home() / ".cache" / "hsfarm")
        copy = root / "tiny"
        shutil.copytree(tiny, copy, ignore=shutil.ignore_patterns(".hsfarm-*"))
        first, cached = identity_s(copy)
        print(f"tiny model         {first * 1e3:6.1f} ms first, {cached * 1e3:.1f} ms cached")
        for name, t in (("fastest", one), ("median", one_med)):
            per_core = nbytes / t
            print(f"600 GB at {name} per core: " + ", ".join(
                f"{n} cores {600 * GB / (per_core * n):.0f} s" for n in (8, 16, 32))
                + " of hashing, or the disk's time (600 GB / its read rate) when longer")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
