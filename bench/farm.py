"""The whole farm at Kimi sizes on one machine: Redis, Celery workers, the synthetic server.

    python bench/farm.py [--procs 2 4 8] [--tokens-per-s 5000 0] [--samples 40] [--json out]

Per server rate and worker process count a fresh farm (private Redis, synthetic reference
server, one ``celery worker -c N`` without torch, as on a worker host) runs ``--samples``
samples of 57-115 MB. Reported: samples/s, GB/s, server idle %, tmpfs peak, worker RSS and
CPU per sample, beside copy + fsync + read-back of the same sizes. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from producer.localfarm.farm import LocalFarm
from worker.state.queue_scan import broker_depth

BYTES_PER_TOKEN = 8 + 2 * 4 * 7168
VOCAB = 642


def write_data(path: Path, n: int, seed: int = 0, tokens: tuple[int, int] = (1000, 2000)) -> int:
    """``n`` pre-tokenized samples of ``tokens`` (low, high) tokens; returns the total count."""
    import random

    rng = random.Random(seed)
    total = 0
    with open(path, "w") as f:
        for i in range(n):
            t = rng.randint(*tokens)
            total += t
            ids = [rng.randrange(1, VOCAB) for _ in range(t)]
            f.write(json.dumps({"id": f"s{i:05d}", "input_ids": ids}) + "\n")
    return total


class Monitor:
    """Samples tmpfs use and worker RSS while a run goes."""

    def __init__(self, farm: LocalFarm) -> None:
        self.farm = farm
        self.tmpfs_peak_bytes = 0
        self.rss_peak_mb: dict[int, float] = {}
        self.rss_start_mb: dict[int, float] = {}

    def sample(self) -> None:
        used = 0
        for p in self.farm.dump_dir.iterdir():
            try:
                if p.is_file():
                    used += p.stat().st_size
            except OSError:
                continue
        self.tmpfs_peak_bytes = max(self.tmpfs_peak_bytes, used)
        for proc in self.farm.procs.values():
            if proc.name.startswith("w"):
                for pid in proc.children():
                    rss = _rss_mb(pid)
                    self.rss_start_mb.setdefault(pid, rss)
                    self.rss_peak_mb[pid] = max(self.rss_peak_mb.get(pid, 0.0), rss)

    def worker_pids(self) -> list[int]:
        return [pid for p in self.farm.procs.values() if p.name.startswith("w")
                for pid in [p.pid, *p.children()]]


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def server_info(farm: LocalFarm) -> dict[str, Any]:
    url = f"http://127.0.0.1:{farm.server_port}/server_info"
    with urllib.request.urlopen(url, timeout=10) as r:
        return dict(json.loads(r.read()))


def run_farm(args: argparse.Namespace, rate: float, procs: int, data: Path,
             n: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hsfarm-bench-farm.", dir=args.shm))
    out = Path(tempfile.mkdtemp(prefix=".hsfarm-bench-farm-out.", dir=args.out_dir))
    env = {"FARM_OUTPUT_DIR": str(out), "FARM_MIN_FREE_DUMP_BYTES": str(64 << 20)}
    farm = LocalFarm(work, model="synthetic", cache_dir=args.cache_dir,
                     chunked_prefill_size=8192, extra_env=env,
                     workers_without_torch=args.no_torch_in_workers)
    try:
        farm.start_redis()
        farm.start_server(["--tokens-per-s", str(rate), "--log-level", "WARNING"])
        farm.start_worker("w1", concurrency=procs)
        limits = json.loads(farm.cli("status", "--json").stdout)["admission"]
        res = farm.cli("enqueue", str(data), "--no-progress")
        assert res.returncode == 0, res.stdout + res.stderr
        return _watch(farm, n, limits, out)
    finally:
        farm.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def _watch(farm: LocalFarm, n: int, limits: dict[str, Any], out: Path) -> dict[str, Any]:
    mon = Monitor(farm)
    start: tuple[float, dict[str, Any], int, int, float, float] | None = None
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        mon.sample()
        done, bad = farm.outcomes()
        if start is None and done >= 1:  # the window opens at the first finished sample
            start = (time.monotonic(), server_info(farm), _out_bytes(out), done,
                     cpu_s(mon.worker_pids()), cpu_s([farm.procs["server"].pid]))
        if done + bad >= n and broker_depth(farm.redis(), farm.queue()) == (0, 0):
            break
        time.sleep(0.1)
    end = (time.monotonic(), server_info(farm), _out_bytes(out), done,
           cpu_s(mon.worker_pids()), cpu_s([farm.procs["server"].pid]))
    assert start is not None and bad == 0, f"{bad} samples failed"
    samples = end[3] - start[3]
    wall = end[0] - start[0]
    busy = end[1]["busy_s"] - start[1]["busy_s"]
    uptime = end[1]["uptime_s"] - start[1]["uptime_s"]
    return {"samples": n, "window_s": wall, "samples_per_s": samples / wall,
            "worker_cpu_ms_per_sample": 1e3 * (end[4] - start[4]) / samples,
            "server_cpu_ms_per_sample": 1e3 * (end[5] - start[5]) / samples,
            "gb_per_s": (end[2] - start[2]) / wall / 1e9,
            "server_idle_pct": 100 * (1 - busy / uptime),
            "server_tokens_per_s": (end[1]["tokens_done"] - start[1]["tokens_done"]) / uptime,
            "tmpfs_peak_bytes": mon.tmpfs_peak_bytes,
            "dump_budget_bytes": limits["dump_budget_bytes"],
            "max_in_flight": limits["max_in_flight"],
            "worker_rss_peak_mb": sorted(round(v) for v in mon.rss_peak_mb.values()),
            "worker_rss_growth_mb": max(mon.rss_peak_mb[p] - mon.rss_start_mb[p]
                                        for p in mon.rss_peak_mb)}


def _out_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in (out / "samples").rglob("*.safetensors"))


def baseline_b(args: argparse.Namespace, tokens: list[int]) -> float:
    """Bytes/s of copy + fsync + read back (cache dropped) for dumps of these sizes."""
    dumps = Path(tempfile.mkdtemp(prefix="hsfarm-bench-b.", dir=args.shm))
    out = Path(tempfile.mkdtemp(prefix=".hsfarm-bench-b-out.", dir=args.out_dir))
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        subprocess.run([sys.executable, str(Path(__file__).parent / "dataplane.py"),
                        "--make-dumps", str(dumps), "--tokens", *map(str, tokens),
                        "--count", "1", "--cache-dir", str(args.cache_dir)], check=True)
        files = sorted(dumps.glob("*.safetensors"))
        total, wall = 0, 0.0
        for f in files:
            dst = out / f.name
            os.sync()
            t0 = time.perf_counter()
            shutil.copyfile(f, dst)
            with open(dst, "rb", buffering=0) as g:
                os.fsync(g.fileno())
                os.posix_fadvise(g.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                buf = bytearray(4 << 20)
                while g.readinto(buf):
                    pass
            wall += time.perf_counter() - t0
            total += f.stat().st_size
            dst.unlink()
        return total / wall
    finally:
        shutil.rmtree(dumps, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4, 8],
                   help="worker processes (one celery worker -c N)")
    p.add_argument("--tokens-per-s", type=float, nargs="+", default=[5000.0, 0.0],
                   help="server rates; 0 = as fast as this CPU makes dumps")
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    p.add_argument("--out-dir", type=Path, default=Path.cwd())
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "hsfarm")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--torch-in-workers", dest="no_torch_in_workers", action="store_false",
                   help="let transformers import torch in workers (as in this dev venv)")
    args = p.parse_args(argv)
    data = Path(tempfile.mkdtemp(prefix="hsfarm-bench-data.")) / "data.jsonl"
    total_tokens = write_data(data, args.samples)
    sizes = [1000, 1500, 2000]
    results: dict[str, Any] = {"date": date.today().isoformat(), "machine": platform.node(),
                               "cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg(),
                               "samples": args.samples,
                               "gb_per_run": total_tokens * BYTES_PER_TOKEN / 1e9, "runs": []}
    b_before = baseline_b(args, sizes)
    print(f"baseline (b) before: {b_before / 1e9:.2f} GB/s", flush=True)
    for rate in args.tokens_per_s:
        for procs in args.procs:
            r = {"tokens_per_s": rate, "procs": procs,
                 **run_farm(args, rate, procs, data, args.samples)}
            results["runs"].append(r)
            print(json.dumps(r), flush=True)
    b_after = baseline_b(args, sizes)
    results["baseline_b_gb_per_s"] = (b_before + b_after) / 2e9
    results["baseline_b_spread"] = [b_before / 1e9, b_after / 1e9]
    results["load_avg_at_end"] = os.getloadavg()
    print(f"baseline (b) after: {b_after / 1e9:.2f} GB/s", flush=True)
    for r in results["runs"]:
        r["farm_vs_b"] = r["gb_per_s"] / results["baseline_b_gb_per_s"]
    return report(results, table(results), args.json, data.parent)


def report(results: dict[str, Any], text: str, json_path: Path | None, data_dir: Path) -> int:
    """Print the table, save the raw results (``--json``), remove the run's data."""
    print(text)
    if json_path:
        json_path.write_text(json.dumps(results, indent=1))
    shutil.rmtree(data_dir, ignore_errors=True)
    return 0


def table(results: dict[str, Any]) -> str:
    lines = ["| server rate (tok/s) | procs | samples/s | GB/s | vs (b) | server idle | "
             "tmpfs peak / budget | worker RSS peak (MB) | CPU/sample worker, server (ms) |",
             "|" + "---|" * 9]
    for r in results["runs"]:
        rate = "max" if not r["tokens_per_s"] else f"{r['tokens_per_s']:.0f}"
        lines.append(
            f"| {rate} ({r['server_tokens_per_s']:.0f} served) | {r['procs']} | "
            f"{r['samples_per_s']:.2f} | {r['gb_per_s']:.2f} | {r['farm_vs_b']:.2f}x | "
            f"{r['server_idle_pct']:.1f}% | {r['tmpfs_peak_bytes'] / 1e9:.2f} / "
            f"{r['dump_budget_bytes'] / 1e9:.2f} GB | "
            f"{min(r['worker_rss_peak_mb']):.0f}–{max(r['worker_rss_peak_mb']):.0f} "
            f"(+{r['worker_rss_growth_mb']:.0f} in the run) | "
            f"{r['worker_cpu_ms_per_sample']:.0f}, {r['server_cpu_ms_per_sample']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
