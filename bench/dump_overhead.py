"""How much does dumping hidden states slow the forward pass? (forward + dump) / forward.

    python bench/dump_overhead.py [--tokens 2048 8192] [--hidden 7168] [--out results.json]

A calibrated stand-in forward (bf16 matmuls at ``--target-tokens-per-s``: a real model's ratio,
not an empty loop's) runs alone, with a synchronous ``.cpu()`` + save, and with the hook
(``CudaStager``, ``DumpWriter``): whether the writer kept up, every dump checked bit for bit.
``--device cpu``: a smoke test. Results: docs/benchmarks.md (``bash bench/gpu_run.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_dump import fp8
from engine_dump.cuda_stager import stager_for
from engine_dump.dump_writer import DumpCollector, DumpWriter
from engine_dump.dumpfile import (
    AUX_LAYERS,
    DTYPE_BF16,
    DTYPE_FP8,
    M_LAYERS,
    STORE_DTYPES,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    T_INPUT_IDS,
    bytes_per_token,
    dump_path,
)
from engine_dump.rids import make_rid

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
    """Per-call times, synchronising after each call (for calibration only)."""
    out = []
    for i in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn(i)
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def loop_time(device: str, fn: Callable[[int], object], n: int) -> float:
    """Mean time per call over a loop synchronised only at its ends, as a server runs: an
    asynchronous copy may overlap the next forward, a synchronous dump cannot."""
    sync(device)
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    sync(device)
    return (time.perf_counter() - t0) / n


class Consumer(threading.Thread):
    """Deletes dumps as they appear, as the farm's workers do (tmpfs is RAM)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(daemon=True)
        self.directory = directory
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for p in self.directory.glob("*.safetensors"):
                p.unlink(missing_ok=True)
            time.sleep(0.005)


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
             target_tps: float, max_layers: int,
             dump_dtype: str = DTYPE_BF16) -> dict[str, object]:
    layers = calibrate_layers(hidden, tokens, device, target_tps, max_layers)
    model = StandIn(layers, hidden, device)
    xs = [torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16) for _ in range(2)]
    ids = torch.arange(tokens, device=device, dtype=torch.int64)
    for _ in range(3):
        model.forward(xs[0])

    fwd = loop_time(device, lambda i: model.forward(xs[i % 2]), iters)

    sync_dir = dump_root / f"sync-{tokens}"
    sync_dir.mkdir()
    consumers = [Consumer(sync_dir)]

    def forward_sync_dump(i: int) -> None:
        hid, aux = model.forward(xs[i % 2])
        tensors = {T_INPUT_IDS: ids.cpu(), T_HIDDEN: hid.cpu(), T_AUX: aux.cpu()}
        save_file(tensors, str(sync_dir / f"{i}.safetensors"))
    consumers[0].start()
    sync_s = loop_time(device, forward_sync_dump, iters)
    consumers[0].stop.set()

    hook_dir = dump_root / f"hook-{tokens}"
    writer = DumpWriter(hook_dir, {M_LAYERS: json.dumps(list(model.aux_at))}, max_queue=4,
                        min_free_bytes=0, dtype=dump_dtype)
    stager = stager_for(xs[0])
    collector = DumpCollector(writer, stager=stager)
    last: dict[str, torch.Tensor] = {}

    def forward_hook(i: int) -> None:
        hid, aux = model.forward(xs[i % 2])
        collector.on_forward([make_rid(f"b{i}", 1, tokens)], [0], [tokens], ids, hid, aux)
        last.update(hidden=hid, aux=aux)
    forward_hook(0)  # warm: side stream, pinned pool, writer thread
    writer.flush(timeout_s=600)
    consumers.append(Consumer(hook_dir))
    consumers[1].start()
    hook_s = loop_time(device, forward_hook, iters - 1)
    t0 = time.perf_counter()
    writer.flush(timeout_s=600)
    drain_s = time.perf_counter() - t0
    consumers[1].stop.set()
    consumers[1].join()
    forward_hook(iters - 1)  # one more, kept on disk for the exactness check
    writer.flush(timeout_s=600)
    writer.close()

    got = load_file(str(dump_path(hook_dir, make_rid(f"b{iters - 1}", 1, tokens))))
    want = {T_HIDDEN: last["hidden"], T_AUX: last["aux"]}
    if dump_dtype == DTYPE_FP8:  # the hook's quantization, done here on the device
        hq, hs = fp8.quantize(last["hidden"], 1)
        aq, as_ = fp8.quantize(last["aux"], AUX_LAYERS)
        want = {T_HIDDEN: hq.view(fp8.FP8), T_HIDDEN_SCALE: hs, T_AUX: aq.view(fp8.FP8),
                T_AUX_SCALE: as_}
    exact = (all(torch.equal(_raw(got[k]), _raw(v)) for k, v in want.items())
             and torch.equal(got[T_INPUT_IDS], ids.cpu()))
    bytes_per_dump = tokens * bytes_per_token(dump_dtype, hidden)
    return {
        "dump_dtype": dump_dtype, "tokens": tokens, "hidden": hidden, "layers": layers,
        "iters": iters,
        "forward_ms": fwd * 1e3, "tokens_per_s": tokens / fwd,
        "dump_mb": bytes_per_dump / 1e6,
        "sync_ratio": sync_s / fwd,
        "hook_ratio": hook_s / fwd,
        "hook_ratio_with_drain": (hook_s * (iters - 1) + drain_s) / ((iters - 1) * fwd),
        "hook_blocked_s": writer.blocked_s, "hook_max_queue": writer.max_depth,
        "hook_drain_s": drain_s, "dumps_written": writer.written, "bit_exact": exact,
    }


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor on the host, float8 as its bytes (compared bit for bit)."""
    return t.cpu().view(torch.uint8) if t.dtype == fp8.FP8 else t.cpu()


def chunked_exactness(device: str, root: Path, hidden: int = 256) -> bool:
    """Mixed batches, one request split over three passes, through the device's stager:
    the assembled dump must equal the one-piece dump bit for bit."""
    d = root / "chunks"
    writer = DumpWriter(d, {}, min_free_bytes=0)
    x = torch.randn(300, hidden, device=device, dtype=torch.bfloat16)
    aux = torch.randn(300, 3 * hidden, device=device, dtype=torch.bfloat16)
    ids = torch.arange(300, device=device)
    col = DumpCollector(writer, stager=stager_for(x))
    one, many = make_rid("one", 1, 300), make_rid("many", 1, 300)
    col.on_forward([one], [0], [300], ids, x, aux)
    for start, n in ((0, 100), (100, 150), (250, 50)):
        # other rows first, then ours: a mixed batch; overwrite the source right after the
        # call, as the next layer would, to prove the copy read the right data
        xs = torch.cat([torch.zeros(7, hidden, device=device, dtype=x.dtype), x[start:start + n]])
        auxs = torch.cat([torch.zeros(7, 3 * hidden, device=device, dtype=aux.dtype),
                          aux[start:start + n]])
        idss = torch.cat([torch.zeros(7, device=device, dtype=ids.dtype), ids[start:start + n]])
        col.on_forward(["other", many], [0, start], [7, n], idss, xs, auxs)
        xs.fill_(float("nan"))
        auxs.fill_(float("nan"))
    writer.flush()
    writer.close()
    a = load_file(str(dump_path(d, one)))
    b = load_file(str(dump_path(d, many)))
    return all(torch.equal(a[k], b[k]) for k in a) and torch.equal(a[T_HIDDEN], x.cpu())


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
    p.add_argument("--max-layers", type=int, default=400)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dump-dtype", choices=STORE_DTYPES, default=DTYPE_BF16,
                   help="the hook's storage dtype (fp8_e4m3: quantized on the copy's stream)")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="hsfarm-bench-", dir=args.dump_dir))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {"date": time.strftime("%Y-%m-%d"), "device": gpu, "torch": torch.__version__,
               "dump_dir_fs": args.dump_dir, **pinned_copy_gbps(args.device)}
    sizes: list[dict[str, object]] = []
    results["sizes"] = sizes
    try:
        results["chunked_exact"] = chunked_exactness(args.device, root)
        print(f"chunked assembly through the {args.device} stager bit-exact: "
              f"{results['chunked_exact']}", flush=True)
        for t in args.tokens:
            r = run_size(t, args.hidden, args.device, args.iters, root,
                         args.target_tokens_per_s, args.max_layers, args.dump_dtype)
            sizes.append(r)
            print(f"T={t:5d} H={args.hidden} forward {r['forward_ms']:.1f} ms "
                  f"({r['tokens_per_s']:.0f} tok/s, {r['layers']} layers), dump "
                  f"{r['dump_mb']:.0f} MB | (a) sync {r['sync_ratio']:.2f}x | (b) hook "
                  f"{r['hook_ratio']:.3f}x (with drain {r['hook_ratio_with_drain']:.3f}x), blocked "
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
