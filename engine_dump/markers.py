"""Ready markers: the hook's proof that it runs in a serving process, and which ones are dead.

A marker ``<dump dir>/.ready.<pid>`` (JSON, atomic) holds what the hook serves and who wrote
it: pid, start time, boot id, pid namespace. A marker is **dead** only when it is of this boot
and pid namespace and no process with its pid and start time runs; anything else is
**unknown** and left alone. Servers may share a dump dir: each dump names its writer
(``dumpfile.M_WRITER``), and a reader takes that server start's markers (``of_server``).
Tests: tests/unit/test_markers.py, tests/farm/test_markers.py."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from engine_dump import dumpdir
from engine_dump.dumpfile import (
    PATCH_VERSION,
    READY_PREFIX,
    TMP_MARK,
    WRITER_UNHEALTHY_PREFIX,
    is_temp_name,
)
from engine_dump.process_identity import boot_id, pid_namespace, start_ticks

DEAD, ALIVE, UNKNOWN = "dead", "alive", "unknown"


def process_identity() -> dict[str, object]:
    """Who this process is, in the terms ``state`` checks: what a marker records."""
    pid = os.getpid()
    return {"pid": pid, "start_ticks": start_ticks(pid) or "",
            "boot_id": boot_id(), "pid_ns": pid_namespace(),
            "host": socket.gethostname(),
            # SGLang's schedulers are children of its launcher: the server they belong to
            "ppid": os.getppid()}


def writer_id() -> str:
    """This process as a dump names its writer (``dumpfile.M_WRITER``): the same words as
    ``Marker.writer`` of the marker it wrote."""
    return _writer_of(process_identity())


def _writer_of(info: dict[str, object]) -> str:
    return "/".join(str(info.get(k) or "") for k in ("host", "boot_id", "pid_ns", "pid",
                                                     "start_ticks"))


def write_ready_marker(dump_dir: Path, info: dict[str, object]) -> Path:
    """Write ``.ready.<pid>`` (JSON, atomically, 0600/0640): proof that the hook runs in this
    process.

    Raises:
        dumpdir.DumpDirUnsafe: another user owns the dump dir or can write to it.
    """
    dumpdir.ensure(dump_dir)
    body = {**info, **process_identity(), "time": time.time(),
            "patch_version": PATCH_VERSION}
    path = dump_dir / f"{READY_PREFIX}{os.getpid()}"
    tmp = dump_dir / f"{READY_PREFIX}{os.getpid()}{TMP_MARK}"
    dumpdir.write_private(tmp, json.dumps(body, indent=1, sort_keys=True).encode())
    os.replace(tmp, path)
    return path


def write_unhealthy(dump_dir: Path, why: str) -> Path:
    """Write ``.writer-unhealthy.<pid>`` (JSON, atomically): this process's dump writer
    cannot take the engine's requests (its thread ended, or its queue stayed full), and
    ``why``. Judged as a marker; the writer removes it when it catches up; ``verify`` fails
    and workers pause while one of a process not known dead is there. Test:
    tests/unit/test_markers.py::test_an_unhealthy_writer_fails_verify_and_its_note_goes_with_it.

    Raises:
        OSError, dumpdir.DumpDirUnsafe: it cannot be written.
    """
    body = {**process_identity(), "time": time.time(), "why": why}
    path = dump_dir / f"{WRITER_UNHEALTHY_PREFIX}{os.getpid()}"
    tmp = path.with_name(f"{path.name}{TMP_MARK}")
    dumpdir.write_private(tmp, json.dumps(body, indent=1, sort_keys=True).encode())
    os.replace(tmp, path)
    return path


def clear_unhealthy(dump_dir: Path) -> None:
    """Remove this process's unhealthy-writer note, if there is one."""
    (dump_dir / f"{WRITER_UNHEALTHY_PREFIX}{os.getpid()}").unlink(missing_ok=True)


def unhealthy_writers(dump_dir: Path) -> list[Marker]:
    """The unhealthy-writer notes in ``dump_dir`` of processes not known dead, oldest first."""
    return [m for m in markers(dump_dir, WRITER_UNHEALTHY_PREFIX) if m.state != DEAD]


@dataclass(frozen=True)
class Marker:
    path: Path
    info: dict[str, object]
    state: str  # DEAD, ALIVE or UNKNOWN
    why: str

    @property
    def time(self) -> float:
        try:
            return float(self.info.get("time", 0))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return 0.0

    @property
    def server(self) -> tuple[object, ...]:
        """Which server start wrote it, on this host and boot: the id its hook was given for
        it (``server_id``: vLLM's), else its launcher process (``ppid``: SGLang's schedulers
        are its children). Markers of an older hook have neither: they count as one server."""
        start = self.info.get("server_id") or self.info.get("ppid")
        return (*(self.info.get(k) for k in ("host", "boot_id", "pid_ns")), start)

    @property
    def writer(self) -> str:
        """The process that wrote it, as its dumps name it (``writer_id``)."""
        return _writer_of(self.info)

    def describe_server(self) -> str:
        """Its server start, for people: the id, else the launcher's pid, and the marker."""
        sid = self.info.get("server_id")
        who = f"server {sid}" if sid else f"server process {self.info.get('ppid')}"
        return (f"{who} ({self.path.name}, pid {self.info.get('pid')}, model "
                f"{self.info.get('model_path')}, {self.info.get('dump_dtype') or 'bfloat16'})")

    def line(self) -> str:
        return f"{self.path.name}: {self.state} ({self.why})"


class SharedDumpDir(Exception):
    """Live markers of two server starts, and nothing that says which one is asked about."""


def state(info: dict[str, object]) -> tuple[str, str]:
    """(DEAD/ALIVE/UNKNOWN, why) for a marker's contents, judged from this process."""
    me = process_identity()
    pid, ticks = info.get("pid"), info.get("start_ticks")
    if not info.get("boot_id") or not info.get("pid_ns") or not ticks:
        return UNKNOWN, "written by an older hook: it does not say which process wrote it"
    if info["boot_id"] != me["boot_id"]:
        return UNKNOWN, f"written on host {info.get('host')} in another boot"
    if info["pid_ns"] != me["pid_ns"]:
        return UNKNOWN, (f"written in another pid namespace (another container?) on host "
                         f"{info.get('host')}")
    now = start_ticks(int(pid)) if isinstance(pid, int) else None
    if now is None:
        return DEAD, f"process {pid} is gone"
    if now != ticks:
        return DEAD, f"pid {pid} now belongs to a process started later"
    return ALIVE, f"process {pid} runs"


def markers(dump_dir: Path, prefix: str = READY_PREFIX) -> list[Marker]:
    """The ready markers in ``dump_dir`` (or the notes named ``prefix``: the
    ``WRITER_UNHEALTHY_PREFIX`` ones), oldest first (none when it does not exist)."""
    found = []
    try:
        paths = [p for p in dump_dir.glob(f"{prefix}*") if not is_temp_name(p.name)]
    except OSError:
        return []
    for path in paths:
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to judge
        if isinstance(info, dict):
            found.append(Marker(path, info, *state(info)))
    return sorted(found, key=lambda m: m.time)


def epoch(dump_dir: Path) -> tuple[tuple[str, int], ...]:
    """The ready markers in ``dump_dir`` (name and mtime): they change when a server starts."""
    out = []
    try:
        paths = list(dump_dir.glob(f"{READY_PREFIX}*"))
    except OSError:
        return ()
    for p in paths:
        if is_temp_name(p.name):
            continue
        try:
            out.append((p.name, p.stat().st_mtime_ns))
        except OSError:
            continue
    return tuple(sorted(out))


def live(found: list[Marker]) -> list[Marker]:
    """Of ``found`` (oldest first), those whose process runs, else those not known dead
    (another host's or pid namespace's)."""
    return [m for m in found if m.state == ALIVE] or [m for m in found if m.state != DEAD]


def dp_groups(newest: Marker, found: list[Marker]) -> int:
    """How many DP groups ``newest``'s server start has: the most any of its markers says
    (dead ones too: a group that died is still missing), or its highest rank + 1. vLLM runs a
    dense model's DP ranks as independent engines, each told it is rank 0 of 1 (only
    ``data_parallel_index`` keeps the rank): there the ranks alone give the count.
    Test: tests/unit/test_markers.py::test_dp_groups_count_the_ranks_of_one_server."""
    groups = 1
    for m in found:
        if m.server != newest.server:
            continue
        said, rank = m.info.get("dp_groups"), m.info.get("attn_dp_rank")
        if isinstance(said, int) and not isinstance(said, bool):
            groups = max(groups, said)
        if isinstance(rank, int) and not isinstance(rank, bool):
            groups = max(groups, rank + 1)
    return groups


def of_server(found: list[Marker], writer: str | None) -> list[Marker]:
    """Of ``found`` (oldest first), the markers of one server start, dead ones too: the one
    whose process ``writer`` is (a dump's ``dumpfile.M_WRITER``), else (no writer: an older
    hook's dump, or none asked yet) the only server start with a live marker. Empty when
    the writer left no marker, or no marker lives.

    Raises:
        SharedDumpDir: no writer, and live markers of two or more server starts (named).
    """
    if writer:
        mine = [m for m in found if m.writer == writer]
        return [m for m in found if m.server == mine[-1].server] if mine else []
    alive = live(found)
    starts: dict[tuple[object, ...], Marker] = {m.server: m for m in alive}
    if len(starts) > 1:
        raise SharedDumpDir(
            f"{len(starts)} servers write into this dump dir: "
            + "; ".join(m.describe_server() for m in starts.values())
            + ", and nothing says which one is this worker's (its probe's dump does not name "
            "its writer: a hook older than this hsfarm). Give each server its own dump dir, "
            "or upgrade hsfarm in the servers' python")
    return [m for m in found if m.server == alive[-1].server] if alive else []


def newest_of_server(dump_dir: Path, writer: str | None) -> tuple[Marker | None, list[Marker]]:
    """The newest live marker of ``of_server``'s server start in ``dump_dir`` (None when none
    lives), and all of that start's markers (for ``dp_groups``).

    Raises:
        SharedDumpDir: as ``of_server``.
    """
    mine = of_server(markers(dump_dir), writer)
    alive = live(mine)
    return (alive[-1] if alive else None), mine


def remove_dead(dump_dir: Path, prefix: str = READY_PREFIX) -> list[Marker]:
    """Remove the markers (or ``prefix``'s notes) of dead processes (never an alive or unknown
    one); what went."""
    gone = []
    for m in markers(dump_dir, prefix):
        if m.state == DEAD and _take_if_unchanged(m):
            gone.append(m)
    return gone


def _take_if_unchanged(m: Marker) -> bool:
    """Remove ``m.path`` only if it still holds ``m.info``, race-free against a new process
    that got the same pid and writes its own marker (``os.replace``) at the same moment.

    The marker is first renamed aside (atomic: what is moved is whatever was there at that
    instant), then judged; a live marker moved by mistake goes back with ``link``, which
    fails, harmlessly, when its writer has meanwhile written it again.
    """
    aside = m.path.with_name(f"{m.path.name}{TMP_MARK}dead.{os.getpid()}")
    try:
        os.rename(m.path, aside)
    except FileNotFoundError:
        return False
    try:
        if _contents(aside) == m.info:
            return True
        with contextlib.suppress(FileExistsError):
            os.link(aside, m.path)
        return False
    finally:
        aside.unlink(missing_ok=True)


def _contents(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def build_parser(prog: str = "python -m sglang_patch markers") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog,
                                description="The ready markers in a dump dir, and whose are "
                                "dead (this boot, this pid namespace, the process gone).")
    p.add_argument("--dump-dir", type=Path, required=True)
    p.add_argument("--remove-dead", action="store_true",
                   help="remove the markers of dead processes (never a live or unknown one)")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m sglang_patch markers") -> int:
    """``python -m sglang_patch markers --dump-dir D [--remove-dead]`` (or ``vllm_hook``'s):
    one line per marker."""
    args = build_parser(prog).parse_args(argv)
    if not args.dump_dir.is_dir():
        print(f"no dump dir {args.dump_dir} (the server creates it at start-up)")
        return 0
    found = markers(args.dump_dir)
    removed = {m.path for m in remove_dead(args.dump_dir)} if args.remove_dead else set()
    for m in found:
        print(m.line() + (": removed" if m.path in removed else ""))
    for m in markers(args.dump_dir, WRITER_UNHEALTHY_PREFIX):
        print(f"{m.line()}: its dump writer is unhealthy: {m.info.get('why')}")
    dead = sum(m.state == DEAD for m in found)
    print(f"ready markers in {args.dump_dir}: {len(found)}, of dead processes: {dead}"
          + (f", removed: {len(removed)}" if args.remove_dead else ""))
    return 0
