"""``python -m producer``: enqueue samples, watch a run, show settings.

Exit codes: 0 all well; 1 done, but some records were rejected (or, for ``status --check``,
the run is not finished cleanly); 2 could not run (settings, server, file).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from producer.enqueue import enqueue
from producer.reader import DataFileError
from producer.status import failures, read_status
from sglang_patch.contracts import Fingerprint
from worker.errors import ConfigError
from worker.settings import Settings

EXIT_OK, EXIT_PARTIAL, EXIT_ERROR = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m producer", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("enqueue", help="publish one task per sample of a JSON/JSONL file")
    e.add_argument("file", type=Path)
    e.add_argument("--dry-run", action="store_true", help="check and count, publish nothing")
    e.add_argument("--limit", type=int, default=None, help="only the first N records")
    e.add_argument("--retry-failed", action="store_true",
                   help="publish samples that failed earlier in this run again")
    e.add_argument("--no-progress", action="store_true")
    s = sub.add_parser("status", help="progress of the run")
    s.add_argument("--json", action="store_true")
    s.add_argument("--failures", action="store_true", help="list failed and rejected samples")
    s.add_argument("--watch", type=float, default=0, metavar="S", help="repeat every S seconds")
    s.add_argument("--check", action="store_true",
                   help="exit 0 only if every sample has an outcome and none failed")
    sub.add_parser("settings", help="print the effective settings")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        if args.cmd == "settings":
            print("\n".join(settings.describe()))
            return EXIT_OK
        fingerprint = _fingerprint(settings)
        if args.cmd == "enqueue":
            return _enqueue(settings, fingerprint, args)
        return _status(settings, fingerprint, args)
    except (ConfigError, DataFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


def _fingerprint(settings: Settings) -> Fingerprint:
    from worker.chat import ChatTokenizer
    from worker.fingerprint import compute_fingerprint, resolve_model_path

    model_path = resolve_model_path(settings, wait_s=5)
    chat = ChatTokenizer.from_pretrained(str(model_path), settings.max_tokens, settings.overlong)
    return compute_fingerprint(settings, model_path, chat.tok.chat_template)


def _enqueue(settings: Settings, fingerprint: Fingerprint, args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    summary = enqueue(settings, fingerprint, args.file, dry_run=args.dry_run, limit=args.limit,
                      retry_failed=args.retry_failed, progress=not args.no_progress)
    print(f"run {fingerprint.id}{' (dry run)' if args.dry_run else ''}, "
          f"{time.monotonic() - t0:.1f}s")
    print("\n".join(summary.lines()))
    return EXIT_OK if summary.ok else EXIT_PARTIAL


def _status(settings: Settings, fingerprint: Fingerprint, args: argparse.Namespace) -> int:
    while True:
        st = read_status(settings, fingerprint)
        if args.json:
            print(json.dumps({"run": fingerprint.id, **st.to_json()}))
        else:
            print(f"run {fingerprint.id}: {st.line()}", flush=True)
        if not args.watch or st.finished:
            break
        time.sleep(args.watch)
    if args.failures:
        print("\n".join(failures(settings, fingerprint)))
    if args.check:
        return EXIT_OK if st.finished and st.failed == 0 else EXIT_PARTIAL
    return EXIT_OK
