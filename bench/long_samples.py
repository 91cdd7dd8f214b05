"""Long samples through the whole farm: 32k, 64k and 128k tokens at Kimi's H = 7168.

    python bench/long_samples.py [--tokens 32768 65536 131072] [--json out.json]

One farm (synthetic reference server, one torch-free ``celery worker -c 1``), samples one at a
time. Reported per sample: bytes, wall time, the worker's peak RSS (``VmHWM``, counting the
dump's mapped tmpfs pages), the server's peak RSS (flat: the writer writes each pass's rows
as they come) and the most dump bytes in tmpfs. Results: docs/benchmarks.md, "Long samples".
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
from datetime import date
from pathlib import Path
from typing import Any

from worker.core import outdir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from producer.localfarm.farm import LocalFarm
from worker.core.run import run_id_of
from worker.state import keys

BYTES_PER_TOKEN = 8 + 2 * 4 * 7168
VOCAB = 642


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def write_sample(path: Path, key: str, tokens: int) -> None:
    ids = [(i * 7919) % (VOCAB - 1) + 1 for i in range(tokens)]
    path.write_text(json.dumps({"id": key, "input_ids": ids}) + "\n")


def wait_done(farm: LocalFarm, out: Path, key: str, timeout_s: float,
              shm_peak: list[int]) -> None:
    r = farm.redis()
    run = f"{keys.PREFIX}:{run_id_of(out)}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if r.zscore(f"{run}:{keys.DONE}", key) is not None:
            return
        for name in (keys.FAILED, keys.REJECTED):
            why = r.hget(f"{run}:{name}", key)
            if why is not None:
                raise RuntimeError(f"{key} {name}: {why!r}")
        used = sum(p.stat().st_size for p in farm.dump_dir.glob("*.safetensors*")
                   if p.is_file())
        shm_peak[0] = max(shm_peak[0], used)
        time.sleep(0.2)
    raise TimeoutError(f"{key} not done in {timeout_s}s")


def run(args: argparse.Namespace) -> dict[str, Any]:
    longest = max(args.tokens)
    work = Path(tempfile.mkdtemp(prefix="hsfarm-bench-long.", dir=args.shm))
    out = Path(tempfile.mkdtemp(prefix=".hsfarm-bench-long-out.", dir=args.out_dir))
    env = {"FARM_OUTPUT_DIR": str(out), "FARM_MAX_TOKENS": str(longest),
           "FARM_MIN_FREE_DUMP_BYTES": str(64 << 20)}
    farm = LocalFarm(work, model="synthetic", cache_dir=args.cache_dir,
                     chunked_prefill_size=8192, extra_env=env)
    rows = []
    try:
        farm.start_redis()
        farm.start_server(["--context-length", str(longest + 8), "--log-level", "WARNING"])
        farm.start_worker("w1", concurrency=1)
        admission = json.loads(farm.cli("status", "--json").stdout)["admission"]
        child = farm.procs["w1"].children()[0]
        server = farm.procs["server"].pid
        for tokens in args.tokens:
            key = f"long{tokens}"
            data = work / f"{key}.jsonl"
            write_sample(data, key, tokens)
            shm_peak = [0]
            t0 = time.monotonic()
            res = farm.cli("enqueue", str(data), "--no-progress")
            assert res.returncode == 0, res.stdout + res.stderr
            wait_done(farm, out, key, 1800, shm_peak)
            wall_s = time.monotonic() - t0
            final = outdir.final_path(out, key)
            row = {"tokens": tokens, "file_bytes": final.stat().st_size, "wall_s": wall_s,
                   "worker_peak_rss_mb": peak_rss_mb(child),
                   "server_peak_rss_mb": peak_rss_mb(server), "tmpfs_peak_bytes": shm_peak[0],
                   "load_avg": os.getloadavg()}
            print(json.dumps(row), flush=True)
            rows.append(row)
            final.unlink()  # disk space: the next sample is bigger
            data.unlink()
        return {"date": date.today().isoformat(), "machine": platform.node(),
                "cpus": os.cpu_count(), "dump_budget_bytes": admission["dump_budget_bytes"],
                "rows": rows}
    finally:
        farm.close(kill=True)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def table(res: dict[str, Any]) -> str:
    lines = ["| tokens | final file | wall (enqueue → done) | worker peak RSS "
             "| server peak RSS | tmpfs peak |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['tokens']:,} | {r['file_bytes'] / 1e9:.2f} GB | {r['wall_s']:.1f} s"
                     f" | {r['worker_peak_rss_mb']:.0f} MB"
                     f" | {r['server_peak_rss_mb']:.0f} MB"
                     f" | {r['tmpfs_peak_bytes'] / 1e9:.2f} GB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    p.add_argument("--out-dir", type=Path, default=Path.cwd())
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "hsfarm")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    res = run(args)
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
