"""The canary's margins: how far re-extracted canary states move for what must pass and for
what must fail, on the reference server and on a live SGLang server (CPU).

    python bench/canary_margins.py --server reference|sglang [--json out.json]

Per scenario (``run``: restart, batching, chunking, TP 2, another checkpoint, quantisation or
layer set, ...) a server is started afresh, the canary prompts are sent as a worker sends them
and compared with the baseline (``worker.core.canary.compare``). Results: docs/canary.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from producer.localfarm.farm import Proc, free_port, wait_until
from sglang_patch.tiny_model import ensure_tiny_model
from worker.core import canary as cn
from worker.server.canary_check import extract
from worker.server.client import ServerClient

CACHE = Path.home() / ".cache" / "hsfarm"
LONG_CHUNK = 64  # the long prompt is sized past one chunk of this budget


class Server:
    """A started server: its url, dump dir and a stop function."""

    def __init__(self, url: str, dump_dir: Path, stop: Callable[[], None]) -> None:
        self.url, self.dump_dir, self.stop = url, dump_dir, stop


def start_reference(work: Path, model: Path, extra: list[str]) -> Server:
    port = free_port()
    dumps = work / f"dumps-{port}"
    argv = [sys.executable, "-m", "sglang_patch.reference_server", "--port", str(port),
            "--dump-dir", str(dumps), "--model", str(model), "--threads", "1", *extra]
    proc = Proc(f"ref-{port}", argv, work / f"ref-{port}.log",
                {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}).start()
    wait_until(lambda: dumps.is_dir() and any(dumps.glob(".ready.*")), 120, "reference server")
    return Server(f"http://127.0.0.1:{port}", dumps, proc.stop)


def start_sglang(work: Path, model: Path, extra: list[str], tp: int = 1) -> Server:
    from tests.live.sglang_server import LiveServer

    port = free_port()
    server = LiveServer(model, work, work / f"dumps-{port}", tp=tp, extra=extra, port=port)
    server.start()
    print(f"  (sglang tp={tp} {' '.join(extra)} up in {server.started_s:.0f}s)", flush=True)
    return Server(server.url, server.dumps, server.stop)


def ensure_int4_model(model: Path) -> Path:
    """The same model with its linear weights fake-quantised to INT4 (symmetric, groups of
    32 along the input dimension, stored back in float32): another quantisation, as Kimi-K2.5
    INT4 is of its bf16 original. Embeddings and norms are kept, as INT4 checkpoints do."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = model.parent / f"{model.name}-int4"
    if (out / "config.json").exists():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=".int4.", dir=model.parent))
    for f in model.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp / f.name)
    tensors = load_file(model / "model.safetensors")
    for name, w in tensors.items():
        if w.ndim == 2 and "proj" in name:
            g = w.reshape(w.shape[0], -1, 32)
            scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 7
            tensors[name] = ((g / scale).round().clamp(-8, 7) * scale).reshape(w.shape)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(out)
    return out


def prompts_for(model: Path) -> list[list[int]]:
    from worker.server.canary_check import chat_encoder
    from worker.server.chat import ChatTokenizer

    chat = ChatTokenizer.from_pretrained(str(model), 8192, "truncate")
    return cn.prompt_ids(chat_encoder(chat), LONG_CHUNK, 8192)


async def _extract(server: Server, prompts: list[list[int]], rows: list[np.ndarray],
                   noise: int) -> list[np.ndarray]:
    client = ServerClient(server.url, 600)
    try:
        rng = random.Random(7)
        others = [client.generate(f"other-{i}-{time.time_ns()}",
                                  [rng.randrange(10, 600) for _ in range(rng.randint(50, 300))])
                  for i in range(noise)]
        got = await asyncio.gather(extract(client, server.dump_dir, prompts, rows, 300),
                                   *others)
        return [s for s, _ in got[0]]
    finally:
        await client.close()


def states(server: Server, prompts: list[list[int]], rows: list[np.ndarray],
           noise: int = 0) -> list[np.ndarray]:
    return asyncio.run(_extract(server, prompts, rows, noise))


def row(name: str, expect: str, base: list[cn.Canary], got: list[np.ndarray],
        names: list[str]) -> dict[str, Any]:
    cmp = cn.compare(base, got, names, 1.0, 1.0)
    return {"scenario": name, "expect": expect,
            "layers": {e.name: {"max_rel": e.max_rel, "mean_rel": e.mean_rel}
                       for e in cmp.layers},
            "max_rel": max(e.max_rel for e in cmp.layers),
            "mean_rel": max(e.mean_rel for e in cmp.layers)}


def run(kind: str, work: Path) -> list[dict[str, Any]]:
    model, other = ensure_tiny_model(CACHE), ensure_tiny_model(CACHE, seed=1)
    int4 = ensure_int4_model(model)
    prompts = prompts_for(model)
    rows = [cn.sample_rows(len(p), LONG_CHUNK) for p in prompts]
    names = cn.layer_names((2, 4, 5))
    sg = kind == "sglang"
    # bfloat16 throughout on SGLang (as production serves); float32 on the reference server
    unchunked = ["--chunked-prefill-size", "8192", "--dtype", "bfloat16"] if sg else [
        "--chunked-prefill-size", "-1"]
    start: Callable[..., Server] = start_sglang if sg else start_reference
    print(f"prompts: {[len(p) for p in prompts]} tokens", flush=True)

    s = start(work, model, unchunked)
    try:
        first = states(s, prompts, rows)
        base = [cn.Canary(np.asarray(p), r, st) for p, r, st in zip(prompts, rows, first,
                                                                      strict=True)]
        out = [row("same server, sent again", "pass", base, states(s, prompts, rows), names),
               row("batching (8 other requests in flight)", "pass", base,
                   states(s, prompts, rows, noise=8), names)]
    finally:
        s.stop()

    scenarios: list[tuple[str, str, Path, list[str], int]] = [
        ("restart", "pass", model, unchunked, 1),
        ("chunking (--chunked-prefill-size 64)", "pass", model,
         ["--chunked-prefill-size", "64", *unchunked[2:]], 1),
    ]
    if sg:
        scenarios += [("TP 2 (against TP 1)", "pass", model, unchunked, 2),
                      ("another checkpoint (seed 1)", "fail", other, unchunked, 1),
                      ("another quantisation (INT4 weights)", "fail", int4, unchunked, 1),
                      ("float32 compute (against bfloat16)", "measured", model,
                       ["--chunked-prefill-size", "8192", "--dtype", "float32"], 1)]
    else:
        scenarios += [("float64 numerics", "pass", model, [*unchunked, "--dtype", "float64"], 1),
                      ("another checkpoint (seed 1)", "fail", other, unchunked, 1),
                      ("another quantisation (INT4 weights)", "fail", int4, unchunked, 1),
                      ("bfloat16 compute (against float32)", "measured", model,
                       [*unchunked, "--dtype", "bfloat16"], 1),
                      ("another layer set (1 3 6)", "fail", model,
                       [*unchunked, "--layers-to-capture", "1", "3", "6"], 1)]
    for name, expect, m, extra, tp in scenarios:
        s = start(work, m, extra, tp=tp) if sg else start(work, m, extra)
        try:
            out.append(row(name, expect, base, states(s, prompts, rows), names))
        finally:
            s.stop()
        print(f"  {name}: max {out[-1]['max_rel']:.4%} mean {out[-1]['mean_rel']:.4%}",
              flush=True)
    return out


def report(results: list[dict[str, Any]]) -> str:
    lines = [f"| {'scenario':<40} | expect | worst layer max rel err | worst layer mean rel err |",
             "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['scenario']:<40} | {r['expect']} | {r['max_rel']:.4%} | "
                     f"{r['mean_rel']:.4%} |")
    passing = [r for r in results if r["expect"] == "pass"]
    failing = [r for r in results if r["expect"] == "fail"]
    lines.append("")
    lines.append(f"largest max among must-pass: {max(r['max_rel'] for r in passing):.4%}; "
                 f"smallest max among must-fail: {min(r['max_rel'] for r in failing):.4%}")
    lines.append(f"largest mean among must-pass: {max(r['mean_rel'] for r in passing):.4%}; "
                 f"smallest mean among must-fail: {min(r['mean_rel'] for r in failing):.4%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=["reference", "sglang"], default="reference")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="canary-margins.") as tmp:
        results = run(args.server, Path(tmp))
    text = report(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"server": args.server, "results": results,
                                         "at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                             time.gmtime())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
