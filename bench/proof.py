"""The per-sample proof's cost on a worker host, at Kimi-K2's size, beside a sample's own work.

    python bench/proof.py [--vocab 163840] [--hidden 7168] [--rows 8 32 128] [--tokens 2048]

Maps a bf16 LM head [V, H] (2.35 GB at Kimi's size) as a worker does and times
``proof.recompute`` over ``--rows`` rows (wall, CPU, peak allocation), beside one
``--tokens``-token sample's data path (``OutputStore.write_verified``). Results: docs/proof.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from engine_dump import header_codec
from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS, T_LOSS_MASK
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from worker.core import proof
from worker.core.finalbytes import Part

LAYERS = (2, 30, 58)


def write_head(model_dir: Path, vocab: int, hidden: int) -> None:
    """A one-shard checkpoint holding ``lm_head.weight`` (bf16 bits of N(0, 0.02)), in
    chunks of rows: never the whole matrix in memory."""
    model_dir.mkdir(parents=True, exist_ok=True)
    raw, _ = header_codec.encode({"lm_head.weight": ("BF16", (vocab, hidden))},
                                 {"format": "pt"})
    rng = np.random.default_rng(0)
    with open(model_dir / "model.safetensors", "wb") as f:
        f.write(raw)
        for start in range(0, vocab, 8192):
            rows = min(8192, vocab - start)
            x = rng.normal(0, 0.02, (rows, hidden)).astype(np.float32)
            f.write((proof.round_bf16(x).view(np.uint32) >> 16).astype("<u2").tobytes())
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": hidden,
                                                       "vocab_size": vocab}))


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def time_check(head: proof.LmHead, rows: int, hidden: int) -> dict[str, float]:
    rng = np.random.default_rng(rows)
    x = proof.round_bf16(rng.normal(0, 1, (rows, hidden)).astype(np.float32))
    targets = rng.integers(0, head.vocab_size, rows)
    tracemalloc.start()  # numpy reports its buffers to it: the check's own peak
    c0, w0 = cpu_s(), time.perf_counter()
    proof.recompute(head, x, targets)
    wall, cpu = time.perf_counter() - w0, cpu_s() - c0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3, "private_mb": peak / 1e6}


def time_sample(out_dir: Path, tokens: int, hidden: int) -> float:
    """Seconds of the worker's own data path for one sample: its final file written,
    fsynced, read back from the device and renamed (``OutputStore.write_verified``)."""
    from worker.core.store import OutputStore

    fp = Fingerprint("c" * 64, "t", "c", LAYERS, LAYER_CONVENTION, hidden, "bfloat16",
                     8192, "reject")
    store = OutputStore(out_dir, fp).open()
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 0x3F80, (tokens, 4 * hidden), dtype=np.uint16)
    parts = {T_INPUT_IDS: Part.from_array("I64", np.arange(tokens, dtype=np.int64)),
             T_LOSS_MASK: Part.from_array("I64", np.ones(tokens, dtype=np.int64)),
             T_HIDDEN: Part.from_array("BF16", bits[:, :hidden]),
             T_AUX: Part.from_array("BF16", bits[:, hidden:])}
    best = float("inf")
    for i in range(3):
        t0 = time.perf_counter()
        v = store.write_verified(f"bench-{i}", parts, {store_content(): "0" * 64})
        best = min(best, time.perf_counter() - t0)
        v.path.unlink()
    return best


def store_content() -> str:
    from worker.core.finalfile import M_CONTENT

    return M_CONTENT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dir", type=Path, default=None, help="where the head is written (temp)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model = Path(tmp) / "model"
        t0 = time.perf_counter()
        write_head(model, args.vocab, args.hidden)
        print(f"LM head bf16 [{args.vocab}, {args.hidden}] = "
              f"{args.vocab * args.hidden * 2 / 1e9:.2f} GB written in "
              f"{time.perf_counter() - t0:.1f}s")
        head = proof.open_lm_head(model, args.hidden)
        sample_s = time_sample(Path(tmp) / "out", args.tokens, args.hidden)
        print(f"a {args.tokens}-token sample's data path (write, fsync, read back): "
              f"{sample_s * 1e3:.0f} ms")
        first = time_check(head, args.rows[0], args.hidden)
        print(f"first check ({args.rows[0]} rows, pages mapped in): {first['wall_ms']:.0f} ms "
              f"wall, {first['cpu_ms']:.0f} ms CPU")
        for rows in args.rows:
            r = time_check(head, rows, args.hidden)
            print(f"rows {rows:4d}: {r['wall_ms']:6.0f} ms wall, {r['cpu_ms']:6.0f} ms CPU, "
                  f"+{r['private_mb']:5.0f} MB private; x{r['wall_ms'] / 1e3 / sample_s:.2f} "
                  "the sample's data path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
