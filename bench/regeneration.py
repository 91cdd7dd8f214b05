"""A regenerating run's cost beside the same generations sent straight to the server.

    python bench/regeneration.py [--samples 16] [--max-new-tokens 64] [--procs 4] [--json out]

On one server (the reference server, or ``--sglang``: a live hooked SGLang CPU server; the tiny
model, greedy), after a warm-up: (a) each one-turn sample's generation sent straight, (b) a
regenerating run of them, (c) a plain run extracting what (b) regenerated; overhead per token
= ((b) - (a) - (c)) / tokens. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from producer.localfarm.farm import LocalFarm, wait_until
from worker.core import outdir
from worker.core.finalfile import conversation_of
from worker.state.index import RunIndex
from worker.state.queue_scan import broker_depth

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data.json"


def one_turn_samples(n: int) -> list[dict[str, Any]]:
    """The first ``n`` examples cut to their first user turn and its reply."""
    out = []
    for s in json.loads(EXAMPLES.read_text()):
        msgs = s.get("messages") or [
            {"role": {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"]),
             "content": m["value"]} for m in s["conversations"]]
        msgs = [m for m in msgs if m["role"] != "system"][:2]
        if [m["role"] for m in msgs] == ["user", "assistant"] and len(msgs[0]["content"]) < 2000:
            out.append({"id": s["id"], "messages": msgs})
        if len(out) == n:
            break
    return out


async def direct(port: int, prompts: list[list[int]], max_new: int, procs: int) -> dict[str, Any]:
    import aiohttp

    sem = asyncio.Semaphore(procs)
    latencies: list[float] = []
    tokens = 0

    async def one(session: aiohttp.ClientSession, i: int, ids: list[int]) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            async with session.post(f"http://127.0.0.1:{port}/generate", json={
                    "rid": f"bench-{i}", "input_ids": ids,
                    "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}) as r:
                body = await r.json()
            latencies.append(time.perf_counter() - t0)
            tokens += len(body["output_ids"])

    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, i, ids) for i, ids in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "request_tokens_per_s": tokens / sum(latencies)}


def run(farm: LocalFarm, data: Path, n: int, procs: int) -> float:
    """Enqueue ``data`` and run it to the end with one worker; the wall from enqueue on."""
    farm.start_worker("w1", concurrency=procs)
    t0 = time.perf_counter()
    res = farm.cli("enqueue", str(data), "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    wait_until(lambda: sum(farm.outcomes()) >= n
               and broker_depth(farm.redis(), farm.queue()) == (0, 0), 1800, "the run",
               poll_s=0.1)
    wall = time.perf_counter() - t0
    done, bad = farm.outcomes()
    assert bad == 0 and done == n, (done, bad)
    farm.procs.pop("w1").stop()
    return wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "hsfarm")
    p.add_argument("--json", type=Path)
    p.add_argument("--sglang", action="store_true",
                   help="a live SGLang server (tests/live's launcher; HSFARM_SGLANG_PYTHON)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="hsfarm-bench-regen."))
    gen_env = {"FARM_REGENERATE": "1", "FARM_GEN_MAX_NEW_TOKENS": str(args.max_new_tokens),
               "FARM_GEN_TEMPERATURE": "0", "FARM_GEN_ON_LENGTH": "keep",
               "FARM_MIN_FREE_OUTPUT_BYTES": "0"}
    samples = one_turn_samples(args.samples)
    data = work / "data.json"
    data.write_text(json.dumps(samples))
    live = _live_sglang(work, args.cache_dir) if args.sglang else None
    regen = LocalFarm(work / "regen", cache_dir=args.cache_dir, extra_env=gen_env,
                      **({"server_port": live.port, "dumps": live.dumps} if live else {}))
    try:
        regen.start_redis()
        if live is None:
            regen.start_server(["--log-level", "WARNING"])
        tok = AutoTokenizer.from_pretrained(outdir_model(regen))
        prompts = [tok(tok.apply_chat_template(s["messages"][:1], tokenize=False,
                                               add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"] for s in samples]
        # a first pass warms the server (torch's first calls), so no phase pays for it
        asyncio.run(direct(regen.server_port, prompts[: args.procs], args.max_new_tokens,
                           args.procs))
        a = asyncio.run(direct(regen.server_port, prompts, args.max_new_tokens, args.procs))
        b_wall = run(regen, data, len(samples), args.procs)
        g = RunIndex(regen.redis(), regen.run_id()).generated()
        # (c): the regenerated conversations, extracted by a plain run on the same server
        convs = []
        for s in samples:
            meta_conv = conversation_of(_meta(outdir.final_path(regen.output_dir, s["id"])))
            assert meta_conv is not None
            convs.append({"id": s["id"], "messages": meta_conv["messages"]})
        (work / "regenerated.json").write_text(json.dumps(convs))
        plain = LocalFarm(work / "plain", cache_dir=args.cache_dir,  # a Redis of its own
                          server_port=regen.server_port, dumps=regen.dump_dir,
                          extra_env={"FARM_MIN_FREE_OUTPUT_BYTES": "0"})
        try:
            plain.start_redis()
            c_wall = run(plain, work / "regenerated.json", len(samples), args.procs)
        finally:
            plain.close()
    finally:
        regen.close()
        if live is not None:
            live.stop()
        shutil.rmtree(work, ignore_errors=True)
    tokens = int(g["tokens"])
    result = {
        "server": "sglang" if args.sglang else "reference",
        "date": str(date.today()), "machine": f"{platform.machine()}, "
        f"{__import__('os').cpu_count()} cores", "samples": len(samples),
        "max_new_tokens": args.max_new_tokens, "procs": args.procs,
        "direct": a, "farm": {"wall_s": b_wall, "tokens": tokens,
                              "tokens_per_s": tokens / b_wall,
                              "request_tokens_per_s": tokens / g["seconds"]},
        "extract_only_wall_s": c_wall,
        "overhead_ms_per_token": 1e3 * (b_wall - a["wall_s"] - c_wall) / tokens,
    }
    if tokens != a["tokens"]:  # greedy, yet a batch of other shapes may flip a near tie
        print(f"note: the farm decoded {tokens} tokens, the direct phase {a['tokens']}")
    print(f"direct    {a['tokens']} tokens in {a['wall_s']:.2f}s: {a['tokens_per_s']:.1f} tok/s "
          f"({a['request_tokens_per_s']:.1f} per request)")
    print(f"farm      generate + extract in {b_wall:.2f}s; its requests "
          f"{result['farm']['request_tokens_per_s']:.1f} tok/s each "
          f"({result['farm']['request_tokens_per_s'] / a['request_tokens_per_s']:.2f}x direct)")
    print(f"extract   the regenerated conversations alone in {c_wall:.2f}s")
    print(f"overhead  {result['overhead_ms_per_token']:.2f} ms per generated token "
          f"(farm - direct - extract-only; {b_wall / (a['wall_s'] + c_wall):.2f}x their sum)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def _live_sglang(work: Path, cache_dir: Path) -> Any:
    """A live SGLang CPU server with the hook, on the tiny model, started (tests/live)."""
    from sglang_patch.tiny_model import ensure_tiny_model
    from tests.live.sglang_server import LiveServer

    server = LiveServer(ensure_tiny_model(cache_dir), work / "sglang", work / "sglang-dumps",
                        extra=["--chunked-prefill-size", "8192"])
    server.start()
    return server


def outdir_model(farm: LocalFarm) -> Path:
    """The reference server's model dir (the tiny model, built in the cache dir)."""
    from sglang_patch.tiny_model import ensure_tiny_model

    return ensure_tiny_model(farm.cache_dir)


def _meta(path: Path) -> dict[str, str]:
    from worker.core.tensorfile import header_metadata

    return header_metadata(path)


if __name__ == "__main__":
    raise SystemExit(main())
