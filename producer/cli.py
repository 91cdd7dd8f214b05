"""``python -m producer``: enqueue samples, watch a run, index and export the output.

Exit codes: 0 all well; 1 done, but some records were rejected (or, for ``status --check``,
the run is not finished cleanly); 2 could not run (settings, server, file); 3 ``status
--check``: the run is stalled (its work waits and nothing moves: ``producer/stall.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from engine_dump.fingerprint import Fingerprint
from producer.adopt.cli import add_adopt_parser, main_adopt
from producer.audit import AuditReport, audit, enqueue_limits, place_elsewhere
from producer.enqueue import enqueue, requeue
from producer.prove import DEFAULT_SLACK, prove_files
from producer.status import (
    environmental_rejections,
    failure_entries,
    failures,
    manifest_fingerprint,
    read_status,
    run_settings,
    status_fingerprint,
)
from producer.status_text import render
from training import cli as training_cli
from training.roots import sample_files
from worker.core import run as runs
from worker.core.datafile import DataFileError
from worker.core.errors import ConfigError, FarmError, Transient
from worker.core.settings import Settings, redis_url_given
from worker.core.store import OutputStore
from worker.server.chat import ChatTokenizer
from worker.server.fingerprint import load_run, run_fingerprint
from worker.state import broker
from worker.state.enqueue import EnqueueRefused
from worker.state.hosts import host_id
from worker.state.index import RunIndex

EXIT_OK, EXIT_PARTIAL, EXIT_ERROR, EXIT_STALLED = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m producer", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("enqueue", help="publish one task per sample of a JSON/JSONL file")
    e.add_argument("file", type=Path)
    e.add_argument("--dry-run", action="store_true", help="check and count, publish nothing")
    e.add_argument("--limit", type=int, default=None, help="only the first N records")
    e.add_argument("--retry-failed", action="store_true",
                   help="publish samples that failed earlier in this run again")
    e.add_argument("--redo-host", action="append", default=[], metavar="HOST",
                   help="a host not heard from since Redis lost its data, gone for good: "
                        "extract its samples again (repeat for several)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar (on stderr)")
    e.add_argument("--delete-removed", action="store_true",
                   help="delete the output files of records removed from the file (or "
                        "corrected) instead of keeping them in <output dir>/removed/")
    s = sub.add_parser("status", help="progress of the run")
    s.add_argument("--json", action="store_true",
                   help="one JSON object (per --watch round), nothing else on stdout")
    s.add_argument("--failures", action="store_true",
                   help="list failed, rejected, stale and retrying samples with their reasons")
    s.add_argument("--watch", type=float, default=0, metavar="S", help="repeat every S seconds")
    s.add_argument("--check", action="store_true",
                   help="exit 0 only if every sample has an outcome and none failed; 3 "
                        "while the run is stalled")
    a = sub.add_parser("audit", help="read back and check every output file")
    a.add_argument("--data", type=Path, default=None,
                   help="the data file (default: every file enqueued for this run)")
    a.add_argument("--requeue", action="store_true",
                   help="publish the missing, corrupt and incompatible samples again")
    a.add_argument("--jobs", type=int, default=4, help="files checked in parallel")
    a.add_argument("--prove", action="store_true",
                   help="also prove every whole file's final state against the live server's "
                        "prompt logprobs (docs/proof.md; needs the server)")
    a.add_argument("--prove-slack", type=float, default=DEFAULT_SLACK, metavar="NATS",
                   help="added to each row's bound: the server runs another forward pass")
    a.add_argument("--no-progress", action="store_true",
                   help="no progress bar (on stderr; it shows the rate and the ETA)")
    d = sub.add_parser("demo", help="run the whole farm locally on the example data")
    d.add_argument("--work-dir", type=Path, default=None, help="default: ./demo-out")
    d.add_argument("--data", type=Path, default=None, help="default: examples/data.json")
    d.add_argument("--store-dtype", choices=("bf16", "fp8_e4m3"), default=None,
                   help="how the hidden states are stored, by the server and the workers "
                        "(default: FARM_STORE_DTYPE, else bf16)")
    w = sub.add_parser("dashboard", help="serve the run's dashboard (plots) and /metrics")
    w.add_argument("--address", default="127.0.0.1",
                   help="address to listen on (default: loopback; reach it by SSH tunnel)")
    w.add_argument("--port", type=int, default=5556)
    w.add_argument("--basic-auth", metavar="USER:PASSWORD", default=None,
                   help="HTTP basic auth, as Flower's flag (visible in ps: prefer the file)")
    w.add_argument("--basic-auth-file", metavar="FILE", type=Path, default=None,
                   help="a file holding USER:PASSWORD on its first line")
    w.add_argument("--no-auth", action="store_true",
                   help="serve without a password (refused unless --address is loopback)")
    w.add_argument("--sample-s", type=float, default=10.0, metavar="S",
                   help="how often disks, server, broker and workers are sampled")
    add_adopt_parser(sub)
    st = sub.add_parser("settings", help="print the effective settings")
    st.add_argument("--reference", action="store_true",
                    help="print every setting's default and meaning as Markdown instead "
                         "(the table of docs/settings.md)")
    training_cli.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        if args.cmd == "settings":
            print(Settings.reference() if args.reference else "\n".join(settings.describe()))
            return EXIT_OK
        if args.cmd == "demo":
            from producer.demo import main_demo

            shared = redis_url_given()  # never the default URL's Redis: it may not be ours
            if shared:
                _check_redis_url(settings)
            return main_demo(args.work_dir, args.data, settings if shared else None,
                             args.store_dtype or settings.store_dtype)
        if args.cmd in ("index", "export"):  # the training side: no server, no Redis
            return training_cli.main(args, settings.output_dir)
        _check_redis_url(settings)  # every other command connects to Redis
        if args.cmd == "audit":  # the only command that renders chat templates
            recorded = manifest_fingerprint(settings)  # first: is there a run at all?
            settings = run_settings(settings, recorded)
            model_path, chat, fingerprint = load_run(settings, wait_s=5)
            code = _audit(settings, fingerprint, chat, args, fingerprint.differences(recorded))
            if args.prove:
                code = max(code, _prove(settings, model_path, fingerprint, args))
            return code
        if args.cmd == "status":  # from the manifest: no server needed
            manifest_fingerprint(settings)  # no run there: said at once, not after 5 s
            fingerprint, source = status_fingerprint(settings)
            return _status(settings, fingerprint, source, args)
        if args.cmd == "adopt":
            return main_adopt(settings, args)
        if args.cmd == "dashboard":
            from producer.dashboard.server import main_dashboard

            return main_dashboard(settings, args)
        model_path, fingerprint = run_fingerprint(settings, wait_s=5)
        return _enqueue(settings, fingerprint, model_path, args)
    except (ConfigError, DataFileError, EnqueueRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except Transient as e:
        print(f"error: Redis at {broker.where(settings)} did not answer ({e}); is it running? "
              "is REDIS_URL right?", file=sys.stderr)
        return EXIT_ERROR
    except FarmError as e:  # adopt: the server or the output disk failed under it
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_ERROR


def _check_redis_url(settings: Settings) -> None:
    """Refuse an open-door ``REDIS_URL`` (``ConfigError``), or say that it was allowed."""
    allowed = broker.check_auth(settings)
    if allowed:
        print(f"warning: {allowed}", file=sys.stderr)


def _enqueue(settings: Settings, fingerprint: Fingerprint, model_path: Path,
             args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    summary = enqueue(settings, fingerprint, args.file, dry_run=args.dry_run, limit=args.limit,
                      retry_failed=args.retry_failed, progress=not args.no_progress,
                      model_path=model_path, delete_removed=args.delete_removed,
                      redo_hosts=tuple(args.redo_host))
    run_id = runs.run_id_of(settings.output_dir)
    print(f"run {run_id}{' (dry run)' if args.dry_run else ''}, queue "
          f"{runs.queue_for(settings, run_id)}, {time.monotonic() - t0:.1f}s")
    print("\n".join(summary.lines()))
    return EXIT_OK if summary.ok else EXIT_PARTIAL


def _status(settings: Settings, fingerprint: Fingerprint, source: str,
            args: argparse.Namespace) -> int:
    run_id = runs.run_id_of(settings.output_dir)
    while True:
        st = read_status(settings, fingerprint)
        if args.json:
            body: dict[str, object] = {"run": run_id, "fingerprint_from": source,
                                       **st.to_json()}
            if args.failures:
                body["failures"] = failure_entries(settings)
            print(json.dumps(body), flush=True)
        else:
            print("\n".join(render(st, run_id, source)), flush=True)
        if not args.watch or st.finished:
            break
        time.sleep(args.watch)
        if not args.json:
            print()
    if args.failures and not args.json:
        print("\n".join(failures(settings)))
    if args.check:
        gone = st.files_gone
        if gone:
            print(f"{gone} samples marked done have no file any more (first: "
                  f"{st.files_gone_samples[0]}); run 'python -m producer enqueue <data file>' "
                  "to extract them again", file=sys.stderr)
        not_theirs = environmental_rejections(settings)
        if not_theirs:
            key, why = not_theirs[0]
            print(f"{len(not_theirs)} samples are marked rejected for an answer of the server "
                  f"or a gateway, not for their content (first: {key}: {why[:160]!r}); run "
                  "'python -m producer enqueue <data file>' again to retry them",
                  file=sys.stderr)
        if st.stall:
            print(f"stalled: {st.stall['reason']}. Fix: {st.stall['fix']}", file=sys.stderr)
            return EXIT_STALLED
        ok = (st.finished and st.failed == 0 and st.stale == 0 and not gone
              and not not_theirs)
        return EXIT_OK if ok else EXIT_PARTIAL
    return EXIT_OK


def _prove(settings: Settings, model_path: Path, fingerprint: Fingerprint,
           args: argparse.Namespace) -> int:
    """``audit --prove``: every final file of this host's output dir (``producer.prove``)."""
    files = sample_files(settings.output_dir)
    report = prove_files(settings, model_path, fingerprint.hidden_size, fingerprint.dtype,
                         files, settings.proof_rows, args.prove_slack)
    print("\n".join(report.lines()))
    return EXIT_OK if not report.failed else EXIT_PARTIAL


def _audit(settings: Settings, fingerprint: Fingerprint, chat: ChatTokenizer,
           args: argparse.Namespace, differences: list[str]) -> int:
    if args.data is not None:
        files = [args.data]
    else:
        index = RunIndex(broker.client(settings), runs.run_id_of(settings.output_dir))
        files = [Path(f) for f in sorted(index.data_files())]
        if not files:
            raise ConfigError("no data file recorded for this run: pass --data FILE")
    store = OutputStore(settings.output_dir, fingerprint)
    report = AuditReport(differences=differences)
    bar = tqdm(total=0, unit="file", desc="audit", disable=args.no_progress, file=sys.stderr)
    limits = enqueue_limits(settings.output_dir)
    try:
        for data in files:
            report.add(audit(store, chat, data, settings.max_record_bytes, jobs=args.jobs,
                             bar=bar, limit=limits.get(str(data.resolve()))))
    finally:
        bar.close()
    try:
        place_elsewhere(report, broker.client(settings), runs.run_id_of(settings.output_dir),
                        host_id(settings))
    except Transient as e:  # the disk is checked all the same
        print(f"note: Redis did not answer ({e}): samples on other hosts count as missing")
    if args.data is None:
        report.look_beyond(settings.output_dir)
    print(f"run {runs.run_id_of(settings.output_dir)}, data: "
          f"{', '.join(str(f) for f in files)}")
    print("\n".join(report.lines()))
    if args.requeue and report.to_requeue:
        print(f"requeued: {requeue(settings, store.open(), report.to_requeue)}")
    return EXIT_OK if report.ok else EXIT_PARTIAL
