"""fp8 storage against bf16: bytes per sample, the error per layer, CPU per sample.

    python bench/fp8_storage.py [--tokens 2048] [--hidden 7168] [--sglang] [--json out.json]

Parts: **outliers** (rows with a massive channel: one scale per row against blocks of 128 and
32), **synthetic** (the hook's writer in bf16 and fp8, then the worker's data path), **tiny**
(the reference server's model) and **sglang** (live SGLang on CPU, one prompt as a sample and
as the canary). Error: per token ``|fp8 - bf16|_2 / |bf16|_2``. Results: docs/fp8.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_dump import fp8 as codec
from engine_dump.dump_writer import DumpCollector, DumpWriter
from engine_dump.dumpfile import (
    AUX_LAYERS,
    DTYPE_BF16,
    DTYPE_FP8,
    ENV_DUMP_DTYPE,
    FP8_BLOCK,
    M_CONFIG_SHA,
    M_LAYERS,
    STORE_DTYPES,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    T_INPUT_IDS,
    bytes_per_token,
    dump_path,
    fp8_blocks,
)
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from engine_dump.rids import INTERNAL_KEY_PREFIX, make_rid
from sglang_patch.synthetic import SyntheticModel, ensure_synthetic_model
from sglang_patch.tiny_model import ensure_tiny_model
from worker.core.store import OutputStore
from worker.extract import store_dump

RUN = "0123456789abcdef"
LAYER_NAMES = ["aux 0", "aux 1", "aux 2", "final"]


def layer_errors(bf16: dict[str, torch.Tensor],
                 fp8: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Per layer (three aux, then final): max and mean over tokens of the relative L2 error."""
    want = torch.cat([bf16[T_AUX], bf16[T_HIDDEN]], dim=1).float()
    got = torch.cat([codec.dequantize(fp8[T_AUX].view(torch.uint8), fp8[T_AUX_SCALE],
                                      torch.float32, layers=AUX_LAYERS),
                     codec.dequantize(fp8[T_HIDDEN].view(torch.uint8), fp8[T_HIDDEN_SCALE],
                                      torch.float32, layers=1)], dim=1)
    t = want.shape[0]
    a, b = want.view(t, 4, -1), got.view(t, 4, -1)
    err = (a - b).norm(dim=2) / a.norm(dim=2).clamp_min(1e-30)
    return [{"layer": LAYER_NAMES[i], "max": float(err[:, i].max()),
             "mean": float(err[:, i].mean())} for i in range(4)]


SCHEMES = (("per row (before)", 0), ("blocks of 128 (now)", FP8_BLOCK), ("blocks of 32", 32))


def _blockwise(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` [T, H] quantized and back (float32) with a scale per ``block`` values."""
    q, s = codec.quantize(x, 1, block=block)
    nb = s.shape[1]
    v = torch.nn.functional.pad(q.view(codec.FP8).float(), (0, nb * block - x.shape[1]))
    return (v.view(x.shape[0], nb, block) * s[:, :, None]).view(x.shape[0], -1)[:, :x.shape[1]]


def per_value_errors(x: torch.Tensor, block: int) -> dict[str, float]:
    """One scheme on rows ``x`` [T, H]: per-value and per-row errors, zeros, bytes/value."""
    h = x.shape[1]
    back = _blockwise(x, block or h)
    nz = x != 0
    rel = ((back - x).abs() / x.abs())[nz]
    row = (back - x).norm(dim=1) / x.norm(dim=1)
    return {"median": float(rel.median()), "p99": float(rel.quantile(0.99)),
            "max": float(rel.max()),
            "flushed_per_row": float(((back == 0) & nz).sum(1).float().mean()),
            "flushed_max_row": int(((back == 0) & nz).sum(1).max()),
            "row_l2_max": float(row.max()), "row_l2_mean": float(row.mean()),
            "bytes_per_value": 1 + 4 * fp8_blocks(h, block or h) / h}


def outliers(hidden_size: int, rows: int = 64) -> list[dict[str, Any]]:
    """The per-value table: Gaussian rows and rows with a massive channel, every scheme."""
    out = []
    for magnitude in (0.0, 1e3, 1e4, 1e5):
        x = torch.randn(rows, hidden_size, generator=torch.Generator().manual_seed(0))
        if magnitude:
            x[:, 1234 % hidden_size] = magnitude
        x = x.to(torch.bfloat16).float()
        for name, block in SCHEMES:
            out.append({"rows": f"massive channel {magnitude:.0e}" if magnitude else "Gaussian",
                        "scheme": name, **per_value_errors(x, block)})
    return out


def print_outliers(table: list[dict[str, Any]]) -> None:
    print("| rows | scheme | bytes/value | median | p99 | max | flushed to 0 per row (max) "
          "| row L2 max / mean |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['rows']} | {r['scheme']} | {r['bytes_per_value']:.3f} | "
              f"{r['median']:.2%} | {r['p99']:.2%} | {r['max']:.0%} | "
              f"{r['flushed_per_row']:.1f} ({r['flushed_max_row']}) | "
              f"{r['row_l2_max']:.3%} / {r['row_l2_mean']:.3%} |", flush=True)


def _dump(dump_dir: Path, dtype: str, key: str, ids: list[int], hidden: torch.Tensor,
          aux: torch.Tensor) -> Path:
    """One sample through the hook's writer (one forward pass); the dump's path."""
    writer = DumpWriter(dump_dir, {M_LAYERS: "[]", M_CONFIG_SHA: "bench"}, dtype=dtype,
                        min_free_bytes=0)
    rid = make_rid(key, 1, len(ids), run=RUN)
    DumpCollector(writer).on_forward([rid], [0], [len(ids)], torch.tensor(ids), hidden, aux)
    writer.flush(timeout_s=600)
    writer.close()
    return dump_path(dump_dir, rid)


def _fingerprint(dtype: str, h: int) -> Fingerprint:
    return Fingerprint("bench", "tok", "tpl", (), LAYER_CONVENTION, h, dtype, 1 << 20,
                       "reject")


def _store(out_dir: Path, dump: Path, ids: list[int], dtype: str, h: int,
           repeats: int = 3) -> dict[str, Any]:
    """The worker's data path for one dump, ``repeats`` times (a new final file each): CPU
    and wall seconds of each, and the file's bytes."""
    store = OutputStore(out_dir / dtype, _fingerprint(dtype, h)).open()
    meta = {M_LAYERS: "[]"}
    cpu, wall = [], []
    for i in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        v = store_dump(store, dump, ids, [1] * len(ids), f"s{i}", "h", meta)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"worker_cpu_s": cpu, "worker_wall_s": wall, "final_bytes": v.size_bytes}


def synthetic(cache: Path, tokens: int, hidden_size: int, out_dir: Path,
              dump_root: Path) -> dict[str, Any]:
    model = SyntheticModel(ensure_synthetic_model(cache, hidden_size))
    ids = [(i * 7919) % model.vocab_size for i in range(tokens)]
    out = model.forward_chunk(None, ids, 0)
    torch.set_num_threads(1)
    codec.quantize(out.aux[:64], 3)  # warm-up
    c0 = time.process_time()
    codec.quantize(out.hidden, 1)
    codec.quantize(out.aux, 3)
    quantize_s = time.process_time() - c0
    res: dict[str, Any] = {"tokens": tokens, "hidden_size": hidden_size,
                           "quantize_cpu_s_1thread": quantize_s}
    # (the hook of a bf16 run never dumps the farm's own key differently: "s" is a sample)
    dumps = {}
    for dtype in STORE_DTYPES:
        dump_dir = dump_root / dtype
        dumps[dtype] = _dump(dump_dir, dtype, "s0", ids, out.hidden, out.aux)
        res[dtype] = {"dump_bytes": dumps[dtype].stat().st_size}
    res["errors"] = layer_errors(load_file(str(dumps[DTYPE_BF16])),
                                 load_file(str(dumps[DTYPE_FP8])))
    for dtype in STORE_DTYPES:
        res[dtype].update(_store(out_dir, dumps[dtype], ids, dtype, hidden_size))
        dumps[dtype].unlink(missing_ok=True)
    return res


def tiny(cache: Path, lengths: list[int]) -> dict[str, Any]:
    from sglang_patch.reference_model import ReferenceModel

    model = ReferenceModel(ensure_tiny_model(cache))
    rng = np.random.default_rng(0)
    hidden, aux = [], []
    for n in lengths:
        ids = rng.integers(10, model.vocab_size, n).tolist()
        out = model.forward_chunk(model.new_cache(), ids, 0)
        hidden.append(out.hidden)
        aux.append(out.aux)
    h, a = torch.cat(hidden), torch.cat(aux)
    hq, hs = codec.quantize(h, 1)
    aq, as_ = codec.quantize(a, 3)
    bf16 = {T_HIDDEN: h.to(torch.bfloat16), T_AUX: a.to(torch.bfloat16)}
    fp8 = {T_HIDDEN: hq, T_HIDDEN_SCALE: hs, T_AUX: aq, T_AUX_SCALE: as_}
    return {"prompts": lengths, "hidden_size": model.hidden_size,
            "errors": layer_errors(bf16, fp8)}


def sglang(cache: Path, work: Path, lengths: list[int]) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    from tests.live.sglang_server import LiveServer
    from tests.live.traffic import Req, prompt, send, vocab_size, wait_dump

    model = ensure_tiny_model(cache)
    server = LiveServer(model, work, work / "dumps", extra=["--chunked-prefill-size", "64"],
                        extra_env={ENV_DUMP_DTYPE: DTYPE_FP8})
    server.start()
    try:
        vocab = vocab_size(model)
        reqs = []
        for i, n in enumerate(lengths):
            ids = prompt(n, i, vocab)
            reqs += [Req(make_rid(f"p{i}", 1, n), ids, 0),
                     Req(make_rid(f"{INTERNAL_KEY_PREFIX}p{i}", 1, n), ids, 0)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            for answer in send(server, reqs, pool):
                answer.result()
        fp8s: list[dict[str, torch.Tensor]] = []
        bf16s: list[dict[str, torch.Tensor]] = []
        for r in reqs:
            d = load_file(str(wait_dump(server.dumps, r.rid)))
            (bf16s if INTERNAL_KEY_PREFIX in r.rid else fp8s).append(d)
    finally:
        server.stop()
    cat = {k: torch.cat([d[k] for d in fp8s]) for k in fp8s[0] if k != T_INPUT_IDS}
    ref = {k: torch.cat([d[k] for d in bf16s]) for k in (T_HIDDEN, T_AUX)}
    return {"prompts": lengths, "chunked_prefill_size": 64, "errors": layer_errors(ref, cat)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "hsfarm")
    p.add_argument("--out-dir", type=Path, default=None, help="the worker's output disk")
    p.add_argument("--sglang", action="store_true", help="also a live SGLang server (CPU)")
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny model")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--outliers-only", action="store_true", help="only the per-value table")
    args = p.parse_args(argv)
    table = outliers(args.hidden)
    print_outliers(table)
    if args.outliers_only:
        if args.json:
            args.json.write_text(json.dumps({"outliers": table}, indent=1) + "\n")
        return 0
    shm = Path("/dev/shm")
    need = 3 * args.tokens * bytes_per_token(DTYPE_BF16, args.hidden)
    dump_root = Path(tempfile.mkdtemp(prefix="hsfarm-fp8-",
                                      dir=shm if shutil.disk_usage(shm).free > need else None))
    out_dir = Path(tempfile.mkdtemp(prefix="hsfarm-fp8-out-", dir=args.out_dir))
    try:
        res: dict[str, Any] = {"outliers": table,
                               "synthetic": synthetic(args.cache_dir, args.tokens, args.hidden,
                                                      out_dir, dump_root)}
        print(json.dumps(res["synthetic"], indent=1), flush=True)
        if not args.no_tiny:
            res["tiny"] = tiny(args.cache_dir, [35, 142, 600])
            print(json.dumps(res["tiny"], indent=1), flush=True)
        if args.sglang:
            res["sglang"] = sglang(args.cache_dir, out_dir / "sglang", [35, 142, 600])
            print(json.dumps(res["sglang"], indent=1), flush=True)
    finally:
        shutil.rmtree(dump_root, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
