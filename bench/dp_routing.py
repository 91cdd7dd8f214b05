"""DP-group routing at Kimi sizes: SGLang's round robin against the worker's own choice.

    python bench/dp_routing.py [--groups 4] [--procs 8] [--tokens-per-s 2000] [--samples 40]

Each arm (``FARM_DP_ROUTING`` rule) is a fresh farm against the synthetic reference server
emulating ``--groups`` attention-DP groups in lockstep (``sglang_patch/dp_groups.py``); the
same samples run in every arm, arms alternating. Reported: samples/s and tokens/s against
round robin, step efficiency, per-group tokens and dump bytes. Results: docs/benchmarks.md.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from farm import report, server_info, write_data

from producer.localfarm.farm import LocalFarm
from worker.state.queue_scan import broker_depth

BASELINE = "server"


def run_arm(args: argparse.Namespace, rule: str, data: Path, n: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hsfarm-bench-dp.", dir=args.shm))
    out = Path(tempfile.mkdtemp(prefix=".hsfarm-bench-dp-out.", dir=args.out_dir))
    env = {"FARM_OUTPUT_DIR": str(out), "FARM_MIN_FREE_DUMP_BYTES": str(64 << 20),
           "FARM_DP_ROUTING": rule}
    farm = LocalFarm(work, model="synthetic", cache_dir=args.cache_dir,
                     chunked_prefill_size=args.chunk, extra_env=env)
    try:
        farm.start_redis()
        farm.start_server(["--tokens-per-s", str(args.tokens_per_s), "--attn-dp-size",
                           str(args.groups), "--log-level", "WARNING"])
        farm.start_worker("w1", concurrency=args.procs)
        res = farm.cli("enqueue", str(data), "--no-progress")
        assert res.returncode == 0, res.stdout + res.stderr
        return watch(farm, n)
    finally:
        farm.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def watch(farm: LocalFarm, n: int) -> dict[str, Any]:
    """Poll the server's per-group load until every sample is done; the window's figures."""
    start: tuple[float, dict[str, Any], int] | None = None
    peaks: list[int] = []
    dir_peak = 0
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        info = server_info(farm)
        groups = info["dp_groups"]
        peaks = [max(p, g["dump_bytes_in_dir"]) for p, g in
                 zip(peaks or [0] * len(groups), groups, strict=True)]
        dir_peak = max(dir_peak, sum(g["dump_bytes_in_dir"] for g in groups))
        done, bad = farm.outcomes()
        if start is None and done >= 1:  # the window opens at the first finished sample
            start = (time.monotonic(), info, done)
        if done + bad >= n and broker_depth(farm.redis(), farm.queue()) == (0, 0):
            break
        time.sleep(0.1)
    end = (time.monotonic(), server_info(farm), done)
    assert start is not None and bad == 0, f"{bad} samples failed"
    return figures(start, end, peaks, dir_peak)


def figures(start: tuple[float, dict[str, Any], int], end: tuple[float, dict[str, Any], int],
            peaks: list[int], dir_peak: int) -> dict[str, Any]:
    wall = end[0] - start[0]
    a, b = start[1], end[1]
    tokens = [g1["tokens_done"] - g0["tokens_done"]
              for g0, g1 in zip(a["dp_groups"], b["dp_groups"], strict=True)]
    steps_tokens = b["dp_step_tokens"] - a["dp_step_tokens"]
    capacity = b["dp_step_capacity"] - a["dp_step_capacity"]
    return {"window_s": wall, "samples_per_s": (end[2] - start[2]) / wall,
            "server_tokens_per_s": sum(tokens) / wall,
            "step_efficiency": steps_tokens / capacity if capacity else 1.0,
            "group_tokens": tokens,
            "group_tokens_max_over_mean": max(tokens) / (sum(tokens) / len(tokens)),
            "group_tmpfs_peak_bytes": peaks,
            "tmpfs_peak_bytes": dir_peak,
            "requests_per_group": [g["requests_done"] for g in b["dp_groups"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=4, help="attention-DP groups of the server")
    p.add_argument("--procs", type=int, default=8, help="worker processes (celery -c N)")
    p.add_argument("--chunk", type=int, default=2048, help="chunked prefill size per group")
    p.add_argument("--tokens-per-s", type=float, default=2000.0,
                   help="the server's rate when its groups are even")
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--rules", nargs="+", default=[BASELINE, "least-tokens", "least-bytes"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    p.add_argument("--out-dir", type=Path, default=Path.cwd())
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "hsfarm")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    assert args.rules[0] == BASELINE, f"the first rule is the baseline, {BASELINE!r}"
    data = Path(tempfile.mkdtemp(prefix="hsfarm-bench-dp-data.")) / "data.jsonl"
    total = write_data(data, args.samples, tokens=(1000, 8000))
    results: dict[str, Any] = {"date": date.today().isoformat(), "machine": platform.node(),
                               "cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg(),
                               "args": {k: str(v) for k, v in vars(args).items()},
                               "tokens": total, "runs": []}
    for rnd in range(args.rounds):
        rules = args.rules if rnd % 2 == 0 else [args.rules[0], *reversed(args.rules[1:])]
        base: dict[str, Any] = {}
        for rule in rules:
            r = {"round": rnd, "rule": rule, **run_arm(args, rule, data, args.samples)}
            base = r if rule == BASELINE else base
            r["samples_per_s_vs_baseline"] = r["samples_per_s"] / base["samples_per_s"]
            r["tokens_per_s_vs_baseline"] = (r["server_tokens_per_s"]
                                             / base["server_tokens_per_s"])
            results["runs"].append(r)
            print(json.dumps(r), flush=True)
    results["load_avg_at_end"] = os.getloadavg()
    return report(results, table(results), args.json, data.parent)


def table(results: dict[str, Any]) -> str:
    lines = ["| round | rule | samples/s (vs round robin) | server tok/s (vs) | step "
             "efficiency | group tokens max/mean | group tmpfs peak max / min (GB) | "
             "dump dir peak (GB) |", "|" + "---|" * 8]
    for r in results["runs"]:
        peaks = r["group_tmpfs_peak_bytes"]
        lines.append(
            f"| {r['round']} | {r['rule']} | {r['samples_per_s']:.3f} "
            f"({r['samples_per_s_vs_baseline']:.2f}x) | {r['server_tokens_per_s']:.0f} "
            f"({r['tokens_per_s_vs_baseline']:.2f}x) | {r['step_efficiency']:.3f} | "
            f"{r['group_tokens_max_over_mean']:.3f} | {max(peaks) / 1e9:.2f} / "
            f"{min(peaks) / 1e9:.2f} | {r['tmpfs_peak_bytes'] / 1e9:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
