"""The checks of a running server both hooks' ``verify`` share, one PASS/FAIL line each.

A ready marker of a live hook process, written since the launcher started the server, and
under DP one per group (``check_marker``); one request of ours through the server and its dump
(``check_probe``); the options that ask for them (``add_live_args``, ``live_checks``). Test:
tests/unit/test_markers.py::test_verify_takes_a_live_marker_over_a_newer_dead_one_and_honours_since"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_dump import markers as mk


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"



def add_live_args(p: argparse.ArgumentParser, env: str) -> None:
    """The live checks' options, the same in both hooks' ``verify``; ``env`` is the variable
    that gives this engine's server its dump dir."""
    p.add_argument("--dump-dir", type=Path, default=None,
                   help=f"the server's {env}: check its hook's ready marker")
    p.add_argument("--server", default=None, help="a running server's URL: send it a probe "
                   "request of ours and check its dump (needs --dump-dir)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="how long the probe waits for its dump once the server has answered")
    p.add_argument("--live-only", action="store_true",
                   help="only the checks of a running server (--dump-dir, --server)")
    p.add_argument("--max-age-s", type=float, default=3600.0,
                   help="a marker older than this, whose process is gone, is stale")
    p.add_argument("--since", type=float, default=0.0, metavar="UNIX_TIME",
                   help="only a marker written at or after this time counts (what the "
                   "launcher waits for: one of the server it started)")


def check_marker(dump_dir: Path, max_age_s: float, since: float = 0.0, *, env: str,
                 writer: str | None = None) -> Check:
    """A ready marker of a live hook process: the newest one whose writer is not dead
    (``markers``), written at or after ``since`` (unix time), of the server start whose
    process ``writer`` is (a probe dump's ``dumpfile.M_WRITER``: the dump dir may be
    shared). ``env``: the variable that gives this engine's server its dump dir, for the fix."""
    found = [m for m in mk.markers(dump_dir) if m.time >= since]
    if writer:
        found = mk.of_server(found, writer)
    if not found:
        when = f" written since {time.strftime('%H:%M:%S', time.localtime(since))}" \
            if since else ""
        return Check("ready marker", False,
                     f"none{when} in {dump_dir}: start the server with {env}="
                     f"{dump_dir} and wait until it has loaded the model")
    newest = (mk.live(found) or found)[-1]
    info = newest.info
    age = time.time() - newest.time
    pid_alive = Path(f"/proc/{info.get('pid')}").exists()
    if newest.state == mk.DEAD or (newest.state == mk.UNKNOWN and age > max_age_s
                                   and not pid_alive):
        return Check("ready marker", False,
                     f"{newest.path.name} is {age:.0f}s old and its process {info.get('pid')} "
                     f"is gone: stale, from an earlier server ({newest.why}); restart the "
                     "server with the variable")
    groups = mk.dp_groups(newest, found)
    check = _check_groups(newest, found, groups) if groups > 1 else \
        Check("ready marker", True, f"pid {info.get('pid')} ({_where(newest)}), " + _served(info))
    return _unless_unhealthy(check, dump_dir)


def _unless_unhealthy(check: Check, dump_dir: Path) -> Check:
    """``check`` failed when a writer of a process not known dead says it is unhealthy
    (``markers.write_unhealthy``): the server answers, but dumps no request."""
    notes = mk.unhealthy_writers(dump_dir)
    if not check.ok or not notes:
        return check
    said = "; ".join(f"pid {m.info.get('pid')} ({_where(m)}): {m.info.get('why')}"
                     for m in notes)
    return Check(check.name, False, f"the server's dump writer is unhealthy: {said} "
                 f"({check.detail})")


def _where(m: mk.Marker) -> str:
    return "alive" if m.state == mk.ALIVE else m.why


def _check_groups(newest: mk.Marker, found: list[mk.Marker], groups: int) -> Check:
    """Under DP attention each group's writer leaves its own marker: every group 0..groups-1
    of ``newest``'s server start must have one whose process is not dead."""
    by_rank: dict[object, mk.Marker] = {}
    for m in found:  # oldest first: the newest of a group's markers wins
        if m.server == newest.server:
            by_rank[m.info.get("attn_dp_rank")] = m
    sid = newest.info.get("server_id")
    server = f"server {sid}" if sid else f"server process {newest.info.get('ppid')}"
    seen = ", ".join(f"group {r} pid {by_rank[r].info.get('pid')} ({_where(by_rank[r])})"
                     for r in range(groups) if r in by_rank)
    for rank in range(groups):
        group = by_rank.get(rank)
        if group is None:
            return Check("ready marker", False,
                         f"DP group {rank} of {groups} ({server}): no ready marker; {seen}: "
                         "its scheduler has not loaded the model yet, or failed (see the "
                         "server's log); wait, or restart the server")
        if group.state == mk.DEAD:
            return Check("ready marker", False,
                         f"DP group {rank} of {groups} ({server}): its writer pid "
                         f"{group.info.get('pid')} is dead ({group.why}); the server cannot "
                         "dump that group's requests: restart it")
    return Check("ready marker", True, f"{groups} DP groups of {server}: {seen}; "
                 + _served(newest.info))


def _served(info: dict[str, object]) -> str:
    return (f"{info.get('server_version')}, patch {info.get('patch_version')}, layers "
            f"{info.get('layers_to_capture')}, model {info.get('model_path')} "
            f"config {str(info.get('model_config_sha256'))[:12]}, tp {info.get('tp_size')}, "
            f"weights {_weights(info)}")


def _weights(info: dict[str, object]) -> str:
    w = info.get("weights")
    if not isinstance(w, dict):
        return "not said (an older hook)"
    shards = w.get("shards")
    n = len(shards) if isinstance(shards, list) else 0
    why = f": {w['error']}" if w.get("error") else ""
    return f"{w.get('id')} ({n} shards{why})"


def check_probe(server_url: str, dump_dir: Path, timeout_s: float) -> tuple[Check, str | None]:
    """The probe's check, and the writer its dump names (None: it failed, or an older hook)."""
    from engine_dump.dumpdir import DumpDirUnsafe
    from engine_dump.dumpfile import M_WRITER
    from engine_dump.probe import ProbeFailed, probe_groups

    try:
        done = probe_groups(server_url, dump_dir, timeout_s)
    except (ProbeFailed, DumpDirUnsafe) as e:
        return Check("probe request", False, str(e)), None
    return Check("probe request", True, done.summary), done.metadata.get(M_WRITER)


def live_checks(p: argparse.ArgumentParser, args: argparse.Namespace, env: str) -> list[Check]:
    """The checks ``add_live_args``' options ask for (none without ``--dump-dir``); a wrong
    combination of them stops with ``p.error``."""
    if args.server and args.dump_dir is None:
        p.error(f"--server needs --dump-dir (the server's {env})")
    if args.live_only and args.dump_dir is None:
        p.error("--live-only needs --dump-dir")
    if args.dump_dir is None:
        return []
    if not args.server:
        return [check_marker(args.dump_dir, args.max_age_s, args.since, env=env)]
    # the probe first: its dump names the server start whose markers are checked
    probed, writer = check_probe(args.server, args.dump_dir, args.timeout_s)
    return [check_marker(args.dump_dir, args.max_age_s, args.since, env=env, writer=writer),
            probed]


def verify_main(p: argparse.ArgumentParser, argv: list[str] | None, env: str,
                install_checks: Callable[[], list[Check]]) -> int:
    """A hook's ``verify``: its install checks (not with ``--live-only``), then the live
    checks; one line each; 0 only when all pass."""
    args = p.parse_args(argv)
    live = live_checks(p, args, env)
    results = live if args.live_only else install_checks() + live
    for r in results:
        print(r.line(), flush=True)
    return 0 if all(r.ok for r in results) else 1
