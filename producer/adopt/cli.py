"""The ``adopt`` subcommand's arguments and output (the work is ``producer.adopt.procedure``).

Exit codes: 0 every file adopted or already done; 1 some files refused (the rest adopted);
2 the server is not the run's (weights, layers, config, dtype: checked before any source file
is read), the run's canary or the compatibility check failed (nothing adopted), or the
command could not run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from worker.core.settings import Settings

FORMATS = ("auto", "hsfarm", "specforge", "torch")

EXIT_OK, EXIT_PARTIAL, EXIT_ERROR = 0, 1, 2


def add_adopt_parser(sub: Any) -> None:
    a = sub.add_parser("adopt", help="take an earlier run's files (hsfarm, SpecForge, torch) "
                                     "into this run, checked against the server")
    a.add_argument("source", type=Path, help="the earlier run's directory (only read)")
    a.add_argument("--data", type=Path, required=True,
                   help="the data file whose records the files were extracted from")
    a.add_argument("--format", choices=FORMATS, default="auto",
                   help="how the earlier run's files are laid out (default: auto, told from "
                        "the directory's contents)")
    a.add_argument("--key", action="append", default=[], metavar="ROLE=NAME",
                   help="torch format: the dict key of input_ids, loss_mask, hidden_state or "
                        "aux_hidden_state (aux: one key, or three comma-separated)")
    a.add_argument("--check", type=int, default=None, metavar="K",
                   help="files extracted again and compared (default: max(3, sqrt(n)), "
                        "at most 32)")
    a.add_argument("--seed", type=int, default=None, help="repeatable choice of the K files")
    a.add_argument("--dry-run", action="store_true", help="match and check; adopt nothing")
    a.add_argument("--jobs", type=int, default=2,
                   help="files adopted in parallel (default 2)")
    a.add_argument("--no-progress", action="store_true",
                   help="no progress bars (on stderr) while matching, checking and adopting")


def main_adopt(settings: Settings, args: argparse.Namespace) -> int:
    """Run ``adopt`` (imported here: the other commands start without its imports)."""
    from producer.adopt.formats import detect, parse_keys
    from producer.adopt.procedure import Run, adopt
    from worker.core import run as runs
    from worker.core.errors import ConfigError, Corrupt, Transient
    from worker.server.fingerprint import load_run
    from worker.server.limits import server_info, server_max_tokens

    if not args.source.is_dir():
        raise ConfigError(f"{args.source} is not a directory")
    if args.check is not None and args.check < 1:
        raise ConfigError("--check must be at least 1: adopted files are always checked")
    keys = parse_keys(args.key)
    if args.format == "auto":
        args.format = detect(args.source)  # an unknown format: refused before any work
    model_path, chat, fingerprint = load_run(settings, wait_s=5)
    chat.server_max_tokens = server_max_tokens(settings, server_info(settings, wait_s=5))
    t0 = time.monotonic()
    try:
        report = adopt(Run(settings, chat, fingerprint, model_path), args.source, args.data,
                       fmt=args.format, keys=keys, check_k=args.check, dry_run=args.dry_run,
                       jobs=args.jobs, progress=not args.no_progress, seed=args.seed)
    except (Transient, Corrupt) as e:
        print(f"error: the compatibility check could not extract through the server at "
              f"{settings.server_url} ({type(e).__name__}: {e}); nothing was adopted",
              file=sys.stderr)
        return EXIT_ERROR
    print(f"run {runs.run_id_of(settings.output_dir)}{' (dry run)' if args.dry_run else ''}, "
          f"source {args.source}, {time.monotonic() - t0:.1f}s")
    print("\n".join(report.lines()))
    if not report.compatible:
        return EXIT_ERROR
    return EXIT_OK if report.ok else EXIT_PARTIAL
