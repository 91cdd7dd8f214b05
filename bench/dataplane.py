"""The worker's data path for one sample, beside the least work that gives the same guarantee.

    python bench/dataplane.py [--sizes-mb 1 86 470] [--samples 8] [--json out.json]

Kimi-shaped dumps written by the real ``DumpWriter`` go through ``farm`` (``store_dump``),
``legacy`` (whole-file reads, safetensors' serialize_file, sha256: the plain-library baseline),
(a) ``copyfile`` + fsync and (b) (a) + read-back, alternating sample by sample so drift falls on
every path alike; the measuring process never imports torch. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from engine_dump.dumpfile import (
    AUX_LAYERS,
    M_CONFIG_SHA,
    M_LAYERS,
    M_PATCH_VERSION,
    M_SERVER_VERSION,
    PATCH_VERSION,
    T_AUX,
    T_HIDDEN,
    T_INPUT_IDS,
    T_LOSS_MASK,
)
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from engine_dump.rids import make_rid

BYTES_PER_TOKEN = 8 + 2 * (1 + AUX_LAYERS) * 7168  # ids + final + 3 aux, bf16
LAYERS = (2, 30, 58)
VOCAB = 642  # the synthetic model dir's tokenizer (the tiny model's)


# --- dumps, made in a child process (torch) -------------------------------------------------

def make_dumps(dump_dir: Path, cache_dir: Path, tokens: list[int], count: int,
               hidden: int) -> None:
    """``count`` dumps per token count, through the synthetic model and the real writer."""
    from engine_dump.dump_writer import DumpCollector, DumpWriter
    from sglang_patch.synthetic import SyntheticModel, ensure_synthetic_model

    model = SyntheticModel(ensure_synthetic_model(cache_dir, hidden), LAYERS)
    meta = {M_LAYERS: json.dumps(list(LAYERS)), M_CONFIG_SHA: model.config_sha256,
            M_PATCH_VERSION: PATCH_VERSION, M_SERVER_VERSION: "bench"}
    writer = DumpWriter(dump_dir, meta, min_free_bytes=0)
    collector = DumpCollector(writer)
    for t in tokens:
        for i in range(count):
            ids = sample_ids(t, i)
            out = model.forward_batch([(ids, 0)])
            collector.on_forward([rid_of(t, i)], [0], [t], out.ids, out.hidden, out.aux)
            writer.flush(timeout_s=600)
    writer.close()
    (dump_dir / "bench.json").write_text(json.dumps({"config_sha256": model.config_sha256}))


def sample_ids(tokens: int, i: int) -> list[int]:
    return [(7 * j + 13 * i + 1) % VOCAB for j in range(tokens)]


def rid_of(tokens: int, i: int) -> str:
    return make_rid(f"bench-t{tokens}-{i}", 1, tokens)


# --- the paths --------------------------------------------------------------------------------

class Paths:
    """The four ways of moving one dump to ``out_dir``; each leaves nothing behind."""

    def __init__(self, out_dir: Path, fingerprint: Fingerprint) -> None:
        from worker.core.store import OutputStore
        from worker.extract import store_dump

        self.store_dump = store_dump  # imported here, not inside the first timed sample
        self.out_dir = out_dir
        self.store = OutputStore(out_dir / "farm", fingerprint).open()
        (out_dir / "copies").mkdir(exist_ok=True)

    def farm(self, dump: Path, ids: list[int], key: str) -> None:
        v = self.store_dump(self.store, dump, ids, [1] * len(ids), key, "0" * 64, {})
        v.path.unlink()

    def legacy(self, dump: Path, ids: list[int], key: str) -> None:
        legacy_path(dump, ids, self.out_dir / "copies" / f"{key}.legacy")

    def copy(self, dump: Path, ids: list[int], key: str) -> None:
        dst = self._copy(dump, key)
        dst.unlink()

    def copy_readback(self, dump: Path, ids: list[int], key: str) -> None:
        dst = self._copy(dump, key)
        with open(dst, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            buf = bytearray(4 << 20)
            while f.readinto(buf):
                pass
        dst.unlink()

    def _copy(self, dump: Path, key: str) -> Path:
        dst = self.out_dir / "copies" / key
        shutil.copyfile(dump, dst)
        with open(dst, "rb") as f:
            os.fsync(f.fileno())
        return dst


def legacy_path(dump: Path, ids: list[int], out: Path) -> None:
    """The plain-library data path, step for step (load_dump, write, verify): the baseline."""
    from safetensors import TensorSpec, deserialize, serialize_file

    def load(path: Path, drop: bool) -> dict[str, np.ndarray]:
        with open(path, "rb") as f:
            if drop:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            raw = f.read()
        dtypes = {"BF16": "<u2", "I64": "<i8"}
        return {n: np.frombuffer(t["data"], dtype=dtypes[str(t["dtype"])])
                .reshape(t["shape"]) for n, t in deserialize(raw)}

    t = load(dump, drop=False)
    assert np.array_equal(t[T_INPUT_IDS], np.asarray(ids, dtype=np.int64))
    for name in (T_HIDDEN, T_AUX):
        assert not np.count_nonzero((t[name] & 0x7F80) == 0x7F80)
    t[T_LOSS_MASK] = np.ones(len(ids), dtype=np.int64)
    sums = {k: hashlib.sha256(np.ascontiguousarray(a).data).hexdigest() for k, a in t.items()}
    specs = {k: TensorSpec(dtype="int64" if a.dtype == np.int64 else "bfloat16",
                           shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
             for k, a in t.items()}
    tmp = out.with_name(out.name + ".tmp")
    serialize_file(specs, str(tmp), metadata={"sha256": json.dumps(sums, sort_keys=True)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    back = load(out, drop=True)
    assert all(hashlib.sha256(a.data).hexdigest() == sums[k] for k, a in back.items())
    out.unlink()


# --- measuring ---------------------------------------------------------------------------------

def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(fn: Callable[[], None]) -> dict[str, float]:
    # Outside the clock: finish the previous path's deletes (this disk is mounted with
    # online discard, which would otherwise land on whichever path fsyncs next).
    os.sync()
    _reset_peak_rss()
    c0, w0 = _cpu_s(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - w0, _cpu_s() - c0
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_mb": _rss_mb("VmHWM")}


def run(args: argparse.Namespace, dump_dir: Path, out_dir: Path) -> dict[str, object]:
    config_sha256 = json.loads((dump_dir / "bench.json").read_text())["config_sha256"]
    fp = Fingerprint(config_sha256, "t", "c", LAYERS,
                     LAYER_CONVENTION, args.hidden, "bfloat16", 8192, "reject")
    paths = Paths(out_dir, fp)
    names = ["farm", "copy", "copy_readback"] + (["legacy"] if args.legacy else [])
    results: dict[str, object] = {"rss_at_start_mb": _rss_mb("VmRSS")}
    for tokens in args.tokens:
        rows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        size = (dump_dir / f"{rid_of(tokens, 0)}.safetensors").stat().st_size
        for i in range(args.samples if tokens > 100 else args.samples * 5):
            j = i % args.count
            dump, ids = dump_dir / f"{rid_of(tokens, j)}.safetensors", sample_ids(tokens, j)
            for name in names[i % len(names):] + names[: i % len(names)]:
                step = functools.partial(getattr(paths, name), dump, ids, f"k{tokens}-{i}")
                rows[name].append(measure(step))
        results[str(tokens)] = summarise(size, rows)
        print_size(tokens, size, results[str(tokens)])  # type: ignore[arg-type]
    return results


def summarise(size: int, rows: dict[str, list[dict[str, float]]]) -> dict[str, object]:
    out: dict[str, object] = {"dump_bytes": size, "samples": len(rows["farm"])}
    for name, rs in rows.items():
        wall = sum(r["wall_s"] for r in rs)
        out[name] = {"bytes_per_s": size * len(rs) / wall,
                     "wall_ms_median": 1e3 * statistics.median(r["wall_s"] for r in rs),
                     "cpu_ms_median": 1e3 * statistics.median(r["cpu_s"] for r in rs),
                     "cpu_ms_mean": 1e3 * statistics.fmean(r["cpu_s"] for r in rs),
                     "peak_rss_mb": max(r["peak_rss_mb"] for r in rs)}
    f, a, b = (out[n] for n in ("farm", "copy", "copy_readback"))
    out["farm_vs_a"] = f["bytes_per_s"] / a["bytes_per_s"]  # type: ignore[index]
    out["farm_vs_b"] = f["bytes_per_s"] / b["bytes_per_s"]  # type: ignore[index]
    out["farm_cpu_vs_a"] = f["cpu_ms_mean"] / a["cpu_ms_mean"]  # type: ignore[index]
    out["farm_cpu_beyond_a_ms"] = f["cpu_ms_mean"] - a["cpu_ms_mean"]  # type: ignore[index]
    if "legacy" in rows:
        out["legacy_vs_a"] = out["legacy"]["bytes_per_s"] / a["bytes_per_s"]  # type: ignore[index]
        out["legacy_vs_b"] = out["legacy"]["bytes_per_s"] / b["bytes_per_s"]  # type: ignore[index]
    return out


def print_size(tokens: int, size: int, r: dict[str, dict[str, float]]) -> None:
    print(f"\nT={tokens} ({size / 1e6:.1f} MB per dump, {r['samples']} samples)")
    print(f"{'path':15} {'MB/s':>8} {'wall ms':>9} {'cpu ms':>8} {'peak RSS MB':>12}")
    for name in ("farm", "legacy", "copy", "copy_readback"):
        if name in r:
            x = r[name]
            print(f"{name:15} {x['bytes_per_s'] / 1e6:8.0f} {x['wall_ms_median']:9.1f} "
                  f"{x['cpu_ms_mean']:8.1f} {x['peak_rss_mb']:12.0f}")
    print(f"farm: {r['farm_vs_a']:.2f}x of (a), {r['farm_vs_b']:.2f}x of (b); CPU "
          f"{r['farm_cpu_vs_a']:.2f}x of (a), {r['farm_cpu_beyond_a_ms']:+.1f} ms beyond it")
    if "legacy_vs_a" in r:
        print(f"legacy: {r['legacy_vs_a']:.2f}x of (a), {r['legacy_vs_b']:.2f}x of (b)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[18, 1500, 8192],
                   help="tokens per dump (18, 1500, 8192 = 1, 86, 470 MB at H=7168)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--samples", type=int, default=8, help="per size (x5 for tiny dumps)")
    p.add_argument("--count", type=int, default=3, help="distinct dumps per size")
    p.add_argument("--no-legacy", dest="legacy", action="store_false")
    p.add_argument("--dump-dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--out-dir", type=Path, default=Path.cwd(),
                   help="a directory on the disk under test (a temp dir is made inside)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "hsfarm")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--make-dumps", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.make_dumps:  # the child process
        make_dumps(args.make_dumps, args.cache_dir, args.tokens, args.count, args.hidden)
        return 0
    dump_dir = Path(tempfile.mkdtemp(prefix="hsfarm-bench-dumps.", dir=args.dump_dir))
    out_dir = Path(tempfile.mkdtemp(prefix=".hsfarm-bench-out.", dir=args.out_dir))
    try:
        child = [sys.executable, __file__, "--make-dumps", str(dump_dir), "--tokens",
                 *map(str, args.tokens), "--count", str(args.count), "--hidden",
                 str(args.hidden), "--cache-dir", str(args.cache_dir)]
        subprocess.run(child, check=True)
        header = {"date": date.today().isoformat(), "machine": platform.node(),
                  "cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg(),
                  "python": platform.python_version()}
        print(json.dumps(header))
        results = {**header, **run(args, dump_dir, out_dir),
                   "load_avg_at_end": os.getloadavg()}
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
