"""``python -m producer index`` and ``python -m producer export``: the logic behind the commands.

Exit codes as the producer's: 0 all well; 1 done, but some samples failed or were rejected;
2 could not run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from training import index, roots, vocab
from training.export.formats import FORMATS
from training.export.runner import DEFAULT_JOBS, export
from worker.core import outdir
from worker.core.errors import ConfigError, Corrupt

EXIT_OK, EXIT_PARTIAL = 0, 1


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``index`` and ``export`` to the producer's sub-commands."""
    i = sub.add_parser("index", help="index the output dir (one row per sample) and count "
                                     "tokens; optionally SpecForge's draft-vocab mapping")
    i.add_argument("--from", dest="out", type=Path, action="append", default=None,
                   help="the output dir (default: FARM_OUTPUT_DIR); repeat it for a run over "
                        "several hosts: the first holds the index, each sample is taken once")
    i.add_argument("--verify", action="store_true",
                   help="also read and check the hidden states of new files")
    i.add_argument("--draft-vocab-size", type=int, default=None)
    i.add_argument("--target-vocab-size", type=int, default=None)
    i.add_argument("--no-progress", action="store_true", help="no progress bar (on stderr)")
    e = sub.add_parser("export", help="export to a trainer's container (verified, resumable)")
    e.add_argument("--to", required=True, choices=sorted(FORMATS),
                   help="the trainer to export for: DEST is written in its container format")
    e.add_argument("dest", type=Path)
    e.add_argument("--from", dest="out", type=Path, action="append", default=None,
                   help="the output dir (default: FARM_OUTPUT_DIR); repeat it for a run over "
                        "several hosts (each host's dir, or copies): each sample is taken once")
    e.add_argument("--jobs", type=int, default=DEFAULT_JOBS,
                   help=f"samples exported in parallel (default {DEFAULT_JOBS})")
    e.add_argument("--delete-source", action="store_true",
                   help="remove each source file once its export verified")
    e.add_argument("--no-progress", action="store_true", help="no progress bar (on stderr)")


def run_index(out_dir: Path, args: argparse.Namespace, also: list[Path]) -> int:
    bar = tqdm(unit="file", desc="index", disable=args.no_progress, file=sys.stderr)
    report = index.refresh(out_dir, verify=args.verify, progress=bar.update, also=also)
    bar.close()
    print("\n".join(report.lines()))
    if args.draft_vocab_size is not None:
        if args.target_vocab_size is None:
            raise ConfigError("--draft-vocab-size needs --target-vocab-size (the model's vocab)")
        path = write_vocab_mapping(out_dir, args.draft_vocab_size, args.target_vocab_size)
        print(f"vocab mapping: {path}")
    return EXIT_PARTIAL if report.rejected else EXIT_OK


def write_vocab_mapping(out_dir: Path, draft_vocab_size: int, target_vocab_size: int) -> Path:
    """``<out>/vocab_mapping-<N>.pt`` ({d2t, t2d}, SpecForge's ``model.vocab_mapping_path``)."""
    import torch

    from worker.core import durable

    try:
        d2t, t2d = vocab.draft_vocab_mapping(index.read_counts(out_dir), draft_vocab_size,
                                             target_vocab_size)
    except (ValueError, Corrupt) as e:
        raise ConfigError(str(e)) from e
    path = outdir.vocab_mapping_path(out_dir, draft_vocab_size)
    tmp = outdir.temp_path(path)
    torch.save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, tmp)
    durable.commit(tmp, path)
    return path


def run_export(out_dir: Path, args: argparse.Namespace, also: list[Path]) -> int:
    total = sum(1 for root in [out_dir, *also] for _ in roots.sample_files(root))
    bar = tqdm(total=total, unit="sample", desc=f"export {args.to}",
               disable=args.no_progress, file=sys.stderr)
    summary = export(out_dir, args.to, args.dest, jobs=args.jobs,
                     delete_source=args.delete_source, progress=bar.update, also=also)
    bar.close()
    print("\n".join(summary.lines()))
    return EXIT_OK if summary.ok else EXIT_PARTIAL


def main(args: argparse.Namespace, default_out: Path) -> int:
    """Dispatch ``index`` / ``export``. Raises ConfigError for the caller to print."""
    out_dir, *also = args.out or [default_out]
    for root in (out_dir, *also):
        if not (root / outdir.MANIFEST).exists():
            raise ConfigError(f"{root} is not an hsfarm output dir (no {outdir.MANIFEST}); "
                              "pass --from OUT or set FARM_OUTPUT_DIR")
    if args.cmd == "index":
        return run_index(out_dir, args, also)
    return run_export(out_dir, args, also)
