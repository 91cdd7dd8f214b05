"""``adopt``'s data path at Kimi sizes, beside a plain durable copy of the same bytes.

    python bench/adopt.py [--files 8] [--tokens 1500] [--rounds 2] [--dir DIR] [--json out.json]

Synthetic SpecForge-style files (86 MB at 1500 tokens) go through ``write_adopted`` (durable
write, read back, every checksum compared) and through ``shutil.copyfile`` + fsync + read-back,
alternating file by file from a cold page cache. Matching and the K-file check need the
server and are not timed. Results: docs/benchmarks.md, "Adopting an earlier run's files".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from engine_dump.dumpfile import AUX_LAYERS
from engine_dump.fingerprint import Fingerprint
from producer.adopt import rows as adopt_rows
from producer.adopt.formats import open_sample
from producer.adopt.write import write_adopted
from worker.core import diskio
from worker.core.store import OutputStore

HIDDEN = 7168
LAYERS = (2, 30, 58)


def fingerprint() -> Fingerprint:
    return Fingerprint(config_sha256="bench", tokenizer_sha256="bench",
                       chat_template_sha256="bench", layers_to_capture=LAYERS,
                       layer_convention="input_of_layer", hidden_size=HIDDEN, dtype="bfloat16",
                       max_tokens=8192, overlong="reject")


def make_files(src: Path, count: int, tokens: int) -> list[Path]:
    """SpecForge-style files of random bf16 values (finite: |x| < 8), distinct ids."""
    import torch

    src.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    base_h = torch.randn(1, tokens, HIDDEN, generator=g).to(torch.bfloat16)
    base_a = torch.randn(1, tokens, AUX_LAYERS * HIDDEN, generator=g).to(torch.bfloat16)
    paths = []
    for i in range(count):
        p = src / f"data_{i}.ckpt"
        ids = torch.arange(tokens, dtype=torch.int64) + i * tokens
        torch.save({"input_ids": ids, "loss_mask": torch.ones(tokens, dtype=torch.int64),
                    "hidden_state": base_h + i, "aux_hidden_state": base_a - i}, p)
        paths.append(p)
    for p in paths:
        _sync_and_drop(p)
    return paths


def _sync_and_drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        diskio.drop_cache(fd)
    finally:
        os.close(fd)


def adopt_one(store: OutputStore, src: Path, i: int) -> None:
    s = open_sample(src, "specforge")
    mask = np.ones(len(s.input_ids), dtype=np.int64)
    write_adopted(store, f"s{i:06d}", "0" * 32, s, mask, {})


def rows_one(src: Path) -> None:
    """The per-file check's source side: the file read once (hashed), its rows, all layers."""
    adopt_rows.picked_of(src.name, open_sample(src, "specforge"), np.random.default_rng(0))


def copy_one(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
        diskio.drop_cache(fd)
        while os.read(fd, 8 << 20):
            pass
    finally:
        os.close(fd)
    diskio.fsync_dir(dst.parent)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path.cwd())
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hsfarm-bench-adopt.", dir=args.dir))
    try:
        files = make_files(work / "src", args.files, args.tokens)
        size = files[0].stat().st_size
        times: dict[str, float] = {"adopt": 0.0, "copy": 0.0, "rows": 0.0}
        for r in range(args.rounds):
            out = work / f"out{r}"
            store = OutputStore(out, fingerprint()).open()
            (work / f"copy{r}").mkdir()
            for i, f in enumerate(files):
                sides = ["adopt", "copy"] if (i + r) % 2 == 0 else ["copy", "adopt"]
                for side in sides:
                    _sync_and_drop(f)
                    t0 = time.perf_counter()
                    if side == "adopt":
                        adopt_one(store, f, i)
                    else:
                        copy_one(f, work / f"copy{r}" / f.name)
                    times[side] += time.perf_counter() - t0
                _sync_and_drop(f)
                t0 = time.perf_counter()
                rows_one(f)
                times["rows"] += time.perf_counter() - t0
            shutil.rmtree(out)
            shutil.rmtree(work / f"copy{r}")
        total_mb = size * args.files * args.rounds / 1e6
        result = {"file_mb": size / 1e6, "files": args.files, "rounds": args.rounds,
                  "adopt_mb_s": total_mb / times["adopt"], "copy_mb_s": total_mb / times["copy"],
                  "ratio": times["copy"] / times["adopt"],
                  "adopt_files_s": args.files * args.rounds / times["adopt"],
                  "rows_files_s": args.files * args.rounds / times["rows"], "host": platform.node(),
                  "cpus": os.cpu_count(), "dir": str(args.dir)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"files: {args.files} x {result['file_mb']:.1f} MB, {args.rounds} rounds")
    print(f"adopt: {result['adopt_mb_s']:.0f} MB/s   copy+fsync+read-back: "
          f"{result['copy_mb_s']:.0f} MB/s   adopt/copy: {result['ratio']:.2f}x")
    print(f"adopt: {result['adopt_files_s']:.2f} files/s   per-file check, source side (cold): "
          f"{result['rows_files_s']:.1f} files/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
