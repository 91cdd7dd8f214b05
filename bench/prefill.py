"""Prefill tok/s of the served model, end to end as verified files on disk, against the same
requests sent straight to the server, with the farm's concurrency swept.

    python bench/prefill.py [--concurrency 1 2 4] [--samples 12] [--tokens 1024] [--json out]
    python bench/prefill.py --server URL --dump-dir D --model-path M ...   # a running server

Without ``--server``: the reference server (tiny model) on this machine. docs/benchmarks.md.
"""

# Per concurrency C: (a) the server alone: the samples' ids sent as C concurrent prefill
# requests with no rid of ours (nothing is dumped), tok/s = tokens / wall; (b) the farm: as
# many new samples of the same lengths enqueued to a private Redis and run by one
# ``celery worker -c C``, tok/s = tokens of samples whose files verified / wall from enqueue
# to the last done. Printed: both, and (b)/(a), measured in the same run.

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from producer.localfarm.farm import LocalFarm
from worker.core.settings import Settings
from worker.server.client import ServerClient


def prompts(n: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` token-id lists of ``tokens`` ids each, below ``vocab`` (id 0 left out)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(tokens)] for _ in range(n)]


async def _straight(url: str, ids: list[list[int]], concurrency: int) -> float:
    """Seconds for ``ids`` sent as prefill requests, ``concurrency`` at a time, rids not ours."""
    client = ServerClient.of(Settings.from_env({"FARM_SERVER_URL": url}), timeout_s=3600)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, sample: list[int]) -> None:
        async with sem:
            await client.generate(f"bench-prefill-{os.getpid()}-{i}", sample)

    try:
        await client.engine()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, s) for i, s in enumerate(ids)))
        return time.perf_counter() - t0
    finally:
        await client.close()


def through_farm(farm: LocalFarm, ids: list[list[int]], concurrency: int, tag: str) -> float:
    """Seconds from enqueue to the last verified file of these samples, one worker -c C."""
    data = farm.work_dir / f"prefill-{tag}.jsonl"
    with open(data, "w") as f:
        for i, sample in enumerate(ids):
            f.write(json.dumps({"id": f"p{tag}-{i:04d}", "input_ids": sample}) + "\n")
    before, _ = farm.outcomes()
    farm.start_worker(f"c{tag}", concurrency=concurrency)
    try:
        t0 = time.perf_counter()
        res = farm.cli("enqueue", str(data), "--no-progress")
        assert res.returncode == 0, res.stdout + res.stderr
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            done, bad = farm.outcomes()
            assert bad == 0, f"{bad} samples failed: see {farm.work_dir / 'logs'}"
            if done - before >= len(ids):
                return time.perf_counter() - t0
            time.sleep(0.05)
        raise TimeoutError("the farm did not finish in an hour")
    finally:
        farm.procs[f"c{tag}"].stop()


def model_vocab(model_path: Path) -> int:
    cfg = json.loads((model_path / "config.json").read_text())
    inner = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return int(inner["vocab_size"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--samples", type=int, default=12, help="per concurrency and path")
    p.add_argument("--tokens", type=int, default=1024, help="per sample")
    p.add_argument("--server", default="", help="a running hooked server (else the reference)")
    p.add_argument("--dump-dir", type=Path, default=None, help="with --server: its dump dir")
    p.add_argument("--model-path", type=Path, default=None, help="with --server: its model")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "hsfarm")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.server and (args.dump_dir is None or args.model_path is None):
        p.error("--server needs --dump-dir and --model-path (the server's)")
    work = Path(tempfile.mkdtemp(prefix="hsfarm-bench-prefill."))
    env = {"FARM_MAX_TOKENS": str(max(8192, args.tokens + 1))}
    if args.model_path:
        env["FARM_MODEL_PATH"] = str(args.model_path)
    farm = LocalFarm(work, cache_dir=args.cache_dir, dumps=args.dump_dir, extra_env=env,
                     chunked_prefill_size=8192)
    results: dict[str, Any] = {
        "date": date.today().isoformat(), "machine": platform.node(), "cpus": os.cpu_count(),
        "server": args.server or "reference server (tiny model, this machine)",
        "samples": args.samples, "tokens_per_sample": args.tokens, "runs": []}
    try:
        farm.start_redis()
        if args.server:
            farm.server_port = int(args.server.rsplit(":", 1)[1].strip("/"))
            model = args.model_path
        else:
            farm.start_server(["--log-level", "WARNING"])
            from sglang_patch.tiny_model import ensure_tiny_model

            model = ensure_tiny_model(args.cache_dir)
        vocab = model_vocab(Path(model))
        url = args.server or f"http://127.0.0.1:{farm.server_port}"
        for c in args.concurrency:
            total = args.samples * args.tokens
            alone = asyncio.run(_straight(url, prompts(args.samples, args.tokens, vocab, c), c))
            farm_s = through_farm(farm, prompts(args.samples, args.tokens, vocab, 1000 + c), c,
                                  str(c))
            run = {"concurrency": c, "server_tok_s": total / alone, "farm_tok_s": total / farm_s,
                   "farm_vs_server": alone / farm_s}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    finally:
        farm.close(kill=True)
        shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def table(results: dict[str, Any]) -> str:
    lines = [f"{results['samples']} samples x {results['tokens_per_sample']} tokens per row; "
             f"server: {results['server']}",
             "| concurrency | server alone (tok/s) | farm, verified files (tok/s) "
             "| farm / server |",
             "|---|---|---|---|"]
    lines += [f"| {r['concurrency']} | {r['server_tok_s']:,.0f} | {r['farm_tok_s']:,.0f} | "
              f"{r['farm_vs_server']:.2f}x |" for r in results["runs"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
