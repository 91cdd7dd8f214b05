"""How often ``adopt`` catches a foreign minority, against the fraction of foreign files.

    python bench/adopt_detect.py [--files 100] [--fractions 0.01,0.05,0.2] [--seeds 5]
                                 [--damage file|tail|shift]"""

# Records extracted by the tiny model (checkpoint A) and another seed's (B) are mixed into
# SpecForge-format sources, B's files at random places (``--damage tail``: A's files whose rows
# from 32 on are B's; ``shift``: A's files shifted by a row from row 40), and ``adopt --dry-run``
# judges each: did
# the K-file check catch it, how many foreign files the per-file check refused, how many good
# ones it refused, and each phase's files/s. Results: docs/benchmarks.md, "What adopt catches".

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from engine_dump.rids import NO_RUN
from producer.adopt import rows as ar
from producer.adopt.formats import open_sample
from producer.adopt.procedure import Run, adopt
from producer.localfarm.farm import LocalFarm
from sglang_patch.tiny_model import ensure_tiny_model
from tests.conftest import CACHE, EXAMPLES, FAST_ENV
from tests.support import adopt_sources as srcs
from worker.core.settings import Settings
from worker.server.fingerprint import load_run


def unique_records(chat: Any, n: int) -> list[dict[str, Any]]:
    """``n`` example records whose token ids no other record has (adopt refuses twins)."""
    from worker.core.samples import validate_record

    seen: dict[tuple[int, ...], int] = {}
    records = json.loads(EXAMPLES.read_text())
    for i, rec in enumerate(records):
        ids = tuple(chat.encode(validate_record(rec)).input_ids)
        seen[ids] = -1 if ids in seen else i
    keep = sorted(i for i in seen.values() if i >= 0)
    if len(keep) < n:
        raise SystemExit(f"only {len(keep)} distinct records in {EXAMPLES}")
    return [records[i] for i in keep[:n]]


def damaged(ea: srcs.Extracted, eb: srcs.Extracted, how: str) -> srcs.Extracted:
    """A foreign file: B's whole (``file``), A's with B's rows from 32 on (``tail``), or A's
    shifted by a row from row 40 (``shift``)."""
    if how == "tail":
        return srcs.tail_of(ea, eb, 32)
    return srcs.shifted_from(ea, 40) if how == "shift" else eb


def write_source(src: Path, a: list[srcs.Extracted], b: list[srcs.Extracted],
                 foreign: set[int], how: str = "file") -> None:
    src.mkdir(parents=True)
    for i, (ea, eb) in enumerate(zip(a, b, strict=True)):
        e = damaged(ea, eb, how) if i in foreign else ea
        torch.save({"input_ids": torch.tensor(e.ids), "loss_mask": torch.tensor(e.mask),
                    "hidden_state": e.hidden[None], "aux_hidden_state": e.aux[None]},
                   src / f"data_{i}.ckpt")


def one(run: Run, src: Path, data: Path, n_foreign: int, foreign: set[int],
        seed: int) -> dict[str, Any]:
    t0 = time.monotonic()
    report = adopt(run, src, data, dry_run=True, progress=False, seed=seed)
    total_s = time.monotonic() - t0
    assert report.check is not None
    names = {f"data_{i}.ckpt" for i in foreign}
    rows_caught = len(names & report.rows.refused_names()) if report.rows else 0
    k_caught = not report.check.passed
    files = _files(src, sorted(foreign))
    alone = ar.check_files(run.settings, NO_RUN, run.fingerprint, files,
                           lambda p: open_sample(p, "specforge"))
    return {"foreign": n_foreign, "rows_alone_refused_foreign": len(alone.refused),
            "seed": seed, "k": len(report.check.files),
            "k_check_caught": k_caught, "rows_refused_foreign": rows_caught,
            "foreign_adopted": 0 if k_caught else n_foreign - rows_caught,
            "good_refused": (len(report.rows.refused) - rows_caught) if report.rows else 0,
            "total_s": round(total_s, 2)}


def _files(src: Path, numbers: Iterable[int]) -> list[tuple[str, Path, int]]:
    """The per-file check's input: (name, path, tokens) of ``data_<i>.ckpt`` files."""
    paths = [src / f"data_{i}.ckpt" for i in numbers]
    return [(p.name, p, len(open_sample(p, "specforge").input_ids)) for p in paths]


def rows_rate(run: Run, src: Path, n: int, run_id: str) -> float:
    """Files per second of the per-file check alone (all ``n`` files)."""
    files = _files(src, range(n))
    t0 = time.monotonic()
    ar.check_files(run.settings, run_id, run.fingerprint, files,
                   lambda p: open_sample(p, "specforge"))
    return n / (time.monotonic() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=100)
    p.add_argument("--fractions", default="0.01,0.05,0.2")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--damage", choices=("file", "tail", "shift"), default="file")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="adopt-detect-"))
    farm = LocalFarm(work / "farm", cache_dir=CACHE, chunked_prefill_size=64,
                     extra_env=dict(FAST_ENV))
    try:
        farm.start_redis()
        farm.start_server()
        settings = Settings.from_env({**farm.env(), "FARM_OUTPUT_DIR": str(work / "out")})
        model_path, chat, fp = load_run(settings)
        run = Run(settings, chat, fp, model_path)
        records = unique_records(chat, args.files)
        data = work / "data.json"
        data.write_text(json.dumps(records))
        a = srcs.extract(model_path, records, chat)
        b = srcs.extract(ensure_tiny_model(CACHE, seed=1), records, chat)
        results = []
        for frac in (float(x) for x in args.fractions.split(",")):
            n_foreign = max(1, round(frac * args.files))
            for seed in range(args.seeds):
                foreign = set(random.Random(10_000 + seed).sample(range(args.files), n_foreign))
                src = work / f"src-{n_foreign}-{seed}"
                write_source(src, a, b, foreign, args.damage)
                results.append(one(run, src, data, n_foreign, foreign, seed))
                print(json.dumps(results[-1]), flush=True)
        clean = work / "src-clean"
        write_source(clean, a, b, set())
        rate = rows_rate(run, clean, args.files, NO_RUN)
        t0 = time.monotonic()
        report = adopt(run, clean, data, dry_run=True, progress=False, seed=0)
        whole = args.files / (time.monotonic() - t0)
        assert report.ok and report.would_adopt == args.files, report.lines()
    finally:
        farm.close(kill=True)
    print(f"\n{'foreign':>8} {'runs':>5} {'K-check caught':>15} {'per-file alone':>15}"
          f" {'foreign adopted':>16} {'good refused':>13}")
    for n_foreign in sorted({r["foreign"] for r in results}):
        rs = [r for r in results if r["foreign"] == n_foreign]
        print(f"{n_foreign:>5}/{args.files} {len(rs):>5} "
              f"{sum(r['k_check_caught'] for r in rs):>10}/{len(rs)} "
              f"{sum(r['rows_alone_refused_foreign'] for r in rs):>10}/{n_foreign * len(rs)} "
              f"{sum(r['foreign_adopted'] for r in rs):>16} "
              f"{sum(r['good_refused'] for r in rs):>13}")
    print(f"per-file check alone: {rate:.1f} files/s; adopt --dry-run of {args.files} clean "
          f"files (identity, match, K check, per-file check): {whole:.1f} files/s")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "rows_files_per_s": rate,
                                         "dry_run_files_per_s": whole}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
