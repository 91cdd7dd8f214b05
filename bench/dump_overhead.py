"""How much does dumping hidden states slow the forward pass? (forward + dump) / forward.

    python bench/dump_overhead.py [--tokens 2048 8192] [--hidden 7168] [--out results.json]

A GPU workload stands in for the model's forward: ``--layers`` bf16 [T,H]x[H,H] matmuls with a
residual, capturing the inputs of three layers (SGLang's aux convention) and the final state,
calibrated to ``--target-tokens-per-s`` (a TP-8 Kimi-K2.5 prefill is in the 10k tokens/s range
per host), so the ratio reflects a real model, not an empty loop. In the same run it measures:

- forward alone (the baseline);
- (a) a synchronous dump inside the forward: ``.cpu()`` to pageable memory, then
  ``safetensors`` save to the dump dir, before the next forward may start;
- (b) this project's hook: ``DumpCollector`` with the ``CudaStager`` (side stream, pinned
  buffers, event) and the ``DumpWriter`` thread behind a bounded queue.

For (b) it also reports whether the writer kept up: time the forward loop spent blocked on
the full queue, the deepest the queue got, and the drain time after the last forward. It
checks that every dump equals the GPU tensors bit for bit. On CPU (``--device cpu``) it runs
as a smoke test of the same code with small sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sglang_patch import contracts as c
from sglang_patch.cuda_stager import stager_for
from sglang_patch.dump_writer import DumpCollector, DumpWriter

AUX_AT = (2, 30, 58)


class StandIn:
    """A stack of bf16 matmuls shaped like a transformer's residual stream."""

    def __init__(self, layers: int, hidden: int, device: str) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        scale = hidden ** -0.5
        self.w = [torch.randn(hidden, hidden, device=device, dtype=torch.bfloat16, generator=g)
                  * scale for _ in range(layers)]
        self.layers = layers
        self.aux_at = tuple(min(i, layers - 1) for i in AUX_AT)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aux = []
        for i, w in enumerate(self.w):
            if i in self.aux_at:
                aux.append(x)
            x = x + torch.tanh(x @ w)
        return x, torch.cat(aux, dim=-1)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[int], object], n: int) -> list[float]:
    out = []
    for i in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn(i)
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def calibrate_layers(hidden: int, tokens: int, device: str, target_tps: float,
                     max_layers: int) -> int:
    probe = StandIn(4, hidden, device)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        probe.forward(x)
    per_layer = statistics.median(timed(device, lambda _: probe.forward(x), 5)) / 4
    want_s = tokens / target_tps
    return max(4, min(max_layers, round(want_s / per_layer)))


def run_size(tokens: int, hidden: int, device: str, iters: int, dump_root: Path,
             target_tps: float, max_layers: int) -> dict[str, object]:
    layers = calibrate_layers(hidden, tokens, device, target_tps, max_layers)
    model = StandIn(layers, hidden, device)
    xs = [torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16) for _ in range(2)]
    ids = torch.arange(tokens, device=device, dtype=torch.int64)
    for _ in range(3):
        model.forward(xs[0])

    base = timed(device, lambda i: model.forward(xs[i % 2]), iters)

    sync_dir = dump_root / f"sync-{tokens}"
    sync_dir.mkdir()

    def forward_sync_dump(i: int) -> None:
        hid, aux = model.forward(xs[i % 2])
        tensors = {c.T_INPUT_IDS: ids.cpu(), c.T_HIDDEN: hid.cpu(), c.T_AUX: aux.cpu()}
        save_file(tensors, str(sync_dir / f"{i}.safetensors"))
    sync_times = timed(device, forward_sync_dump, iters)

    hook_dir = dump_root / f"hook-{tokens}"
    writer = DumpWriter(hook_dir, {c.M_LAYERS: json.dumps(list(model.aux_at))}, max_queue=4,
                        min_free_bytes=0)
    stager = stager_for(xs[0])
    collector = DumpCollector(writer, stager=stager)
    last: dict[str, torch.Tensor] = {}

    def forward_hook(i: int) -> None:
        hid, aux = model.forward(xs[i % 2])
        collector.on_forward([c.make_rid(f"b{i}", 1, tokens)], [0], [tokens], ids, hid, aux)
        last.update(hidden=hid, aux=aux)
    hook_times = timed(device, forward_hook, iters)
    t0 = time.perf_counter()
    writer.flush(timeout_s=600)
    drain_s = time.perf_counter() - t0
    writer.close()

    got = load_file(str(c.dump_path(hook_dir, c.make_rid(f"b{iters - 1}", 1, tokens))))
    exact = (torch.equal(got[c.T_HIDDEN], last["hidden"].cpu())
             and torch.equal(got[c.T_AUX], last["aux"].cpu())
             and torch.equal(got[c.T_INPUT_IDS], ids.cpu()))
    fwd = statistics.median(base)
    bytes_per_dump = tokens * (8 + 4 * hidden * 2)
    return {
        "tokens": tokens, "hidden": hidden, "layers": layers, "iters": iters,
        "forward_ms": fwd * 1e3, "tokens_per_s": tokens / fwd,
        "dump_mb": bytes_per_dump / 1e6,
        "sync_ratio": statistics.median(sync_times) / fwd,
        "hook_ratio": statistics.median(hook_times) / fwd,
        "hook_ratio_mean": statistics.mean(hook_times) / statistics.mean(base),
        "hook_blocked_s": writer.blocked_s, "hook_max_queue": writer.max_depth,
        "hook_drain_s": drain_s, "dumps_written": writer.written, "bit_exact": exact,
    }


def pinned_copy_gbps(device: str, nbytes: int = 1 << 30) -> dict[str, float]:
    if device != "cuda":
        return {}
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, pin in (("pageable", False), ("pinned", True)):
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        dst.copy_(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=pin)
        torch.cuda.synchronize()
        out[f"d2h_{name}_GBps"] = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dump-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--target-tokens-per-s", type=float, default=10000.0)
    p.add_argument("--max-layers", type=int, default=200)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="hsfarm-bench-", dir=args.dump_dir))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {"date": time.strftime("%Y-%m-%d"), "device": gpu, "torch": torch.__version__,
               "dump_dir_fs": args.dump_dir, **pinned_copy_gbps(args.device)}
    sizes: list[dict[str, object]] = []
    results["sizes"] = sizes
    try:
        for t in args.tokens:
            r = run_size(t, args.hidden, args.device, args.iters, root,
                         args.target_tokens_per_s, args.max_layers)
            sizes.append(r)
            print(f"T={t:5d} H={args.hidden} forward {r['forward_ms']:.1f} ms "
                  f"({r['tokens_per_s']:.0f} tok/s, {r['layers']} layers), dump "
                  f"{r['dump_mb']:.0f} MB | (a) sync {r['sync_ratio']:.2f}x | (b) hook "
                  f"{r['hook_ratio']:.3f}x (mean {r['hook_ratio_mean']:.3f}x), blocked "
                  f"{r['hook_blocked_s']:.3f}s, max queue {r['hook_max_queue']}, drain "
                  f"{r['hook_drain_s']:.2f}s, exact {r['bit_exact']}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
