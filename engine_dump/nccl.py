"""The collective setup NCCL chose for the server: read from NCCL's own INFO lines.

On PCIe boxes without NVLink NCCL may misread the topology and pick a 2-channel ring: Kimi-K2.5
prefill then runs at ~876 tok/s instead of ~7,400 on 8x RTX PRO 6000 (NVIDIA/nccl PR #2127),
with nothing wrong in any other log. The launchers start a multi-GPU server with NCCL's INFO
log of INIT and GRAPH in a log dir and read it here once it is ready; preflight reads the same.
Tests: tests/unit/test_nccl.py (fixtures in tests/support/nccl/).
"""

# The lines read, as NCCL 2.18-2.27 prints them after its ``host:pid:tid [dev] NCCL INFO``:
#   NCCL version 2.21.5+cuda12.4
#   comm 0x55d0c1a0 rank 0 nRanks 8 nNodes 1 localRanks 8 localRank 0 MNNVL 0
#   Pattern 4, crossNic 0, nChannels 2, bw 15.000000/15.000000, type SYS/PIX, sameChannels 1
#     (the graph search's result: pattern 4 is the ring, 1-3 the trees, 5 NVLS)
#   Channel 00/02 :    0   1   2   3   4   5   6   7          (one line per ring channel)
#   Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read            (or SHM/direct/direct, NET/IB/0)
#   NCCL_MAX_NCHANNELS set by environment to 32.

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

RING_PATTERN = 4
# A ring this thin on a box of 4+ GPUs is the topology-detection failure (PR #2127)
SLOW_RING_CHANNELS = 2
# What a person may set to steer NCCL; shown by the launchers and preflight, passed through
TUNING_PREFIX = "NCCL_"
DEBUG_VARIABLES = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")

_INFO = re.compile(r"NCCL INFO (?P<text>.*)$")
_VERSION = re.compile(r"^NCCL version (?P<v>\S+)")
_COMM = re.compile(r"^comm 0x[0-9a-f]+ rank (?P<rank>\d+) nRanks (?P<n>\d+) nNodes (?P<nodes>\d+)"
                   r" localRanks (?P<local>\d+)")
_PATTERN = re.compile(r"^Pattern (?P<p>\d+), crossNic \d+, nChannels (?P<c>\d+), "
                      r"bw (?P<bw>[\d.]+)/[\d.]+, type (?P<type>\S+?),")
_RING = re.compile(r"^Channel (?P<i>\d+)/(?P<n>\d+) :\s+\d")
_VIA = re.compile(r"^Channel \d+/\d+ : \d+\[\S+\] -> \d+\[\S+\] (?:\[\w+\] )?via (?P<t>\w+)")
_SET = re.compile(r"^(?P<name>NCCL_\w+) set by environment to (?P<value>\S+?)\.?$")


@dataclass
class Setup:
    """What NCCL said it chose, over every communicator in the log."""

    version: str = ""
    local_ranks: int = 0  # the most GPUs of one node in one communicator
    ring_channels: list[int] = field(default_factory=list)  # nChannels of each ring search
    ring_types: set[str] = field(default_factory=set)  # the paths they take (SYS/PIX, NVL/NVL)
    listed_rings: int = 0  # the most ring channels listed ("Channel 00/16 : 0 1 ...")
    transports: set[str] = field(default_factory=set)  # P2P, SHM, NET
    environment: dict[str, str] = field(default_factory=dict)  # "set by environment"
    lines: int = 0  # NCCL INFO lines read

    @property
    def narrowest_ring(self) -> int:
        """The fewest channels of any ring NCCL chose (the listed count when no search line)."""
        return min(self.ring_channels) if self.ring_channels else self.listed_rings


def parse(lines: Iterable[str]) -> Setup:
    """Read NCCL's INFO lines (anything else is skipped)."""
    s = Setup()
    for raw in lines:
        m = _INFO.search(raw)
        if m is None:
            continue
        s.lines += 1
        _read(s, m["text"].strip())
    return s


def _read(s: Setup, text: str) -> None:
    if m := _VERSION.match(text):
        s.version = m["v"]
    elif m := _COMM.match(text):
        s.local_ranks = max(s.local_ranks, int(m["local"]))
    elif m := _PATTERN.match(text):
        if int(m["p"]) == RING_PATTERN:
            s.ring_channels.append(int(m["c"]))
            s.ring_types.add(m["type"])
    elif m := _VIA.match(text):
        s.transports.add(m["t"])
    elif m := _RING.match(text):
        s.listed_rings = max(s.listed_rings, int(m["n"]))
    elif m := _SET.match(text):
        s.environment[m["name"]] = m["value"]


def verdict(s: Setup) -> tuple[str, str]:
    """``(level, text)``: OK with what NCCL chose, or WARN with the reason and the fix."""
    if s.lines == 0:
        return "WARN", ("NCCL: no NCCL INFO lines to read (a server on one GPU has none; else "
                        "start it with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH, as the "
                        "launchers do)")
    chosen = describe(s)
    ring = s.narrowest_ring
    if s.local_ranks >= 4 and 0 < ring <= SLOW_RING_CHANNELS:
        return "WARN", (
            f"NCCL: {chosen}: a ring of {ring} channels over {s.local_ranks} GPUs is NCCL's "
            "slow ring on PCIe boxes whose topology it misreads (Kimi-K2.5 prefill ~876 tok/s "
            "instead of ~7,400 on 8x RTX PRO 6000; NVIDIA/nccl PR #2127). Give NCCL the box's "
            "topology (NCCL_TOPO_FILE, or a ring graph in NCCL_GRAPH_FILE), or raise its "
            "channels (NCCL_MIN_NCHANNELS=16 NCCL_MAX_NCHANNELS=32, with NCCL_P2P_DISABLE=1 "
            "where P2P does not work), in /etc/hsfarm/env; restart the server and compare "
            "bench/prefill.py")
    return "OK", f"NCCL: {chosen}"


def describe(s: Setup) -> str:
    parts = [f"NCCL {s.version or '(version not logged)'}"]
    if s.local_ranks:
        parts.append(f"{s.local_ranks} GPUs per node")
    ring = s.narrowest_ring
    if ring:
        kinds = "/".join(sorted(t.split("/")[0] for t in s.ring_types)) or "?"
        parts.append(f"ring {ring} channel{'s' * (ring != 1)} (path {kinds})")
    if s.transports:
        parts.append("via " + ", ".join(sorted(s.transports)))
    if s.environment:
        parts.append("set: " + " ".join(f"{k}={v}" for k, v in sorted(s.environment.items())))
    return ", ".join(parts)


LOG_DIR_VARIABLE = "HSFARM_NCCL_LOG_DIR"


def log_dirs(port: int, environ: dict[str, str]) -> list[Path]:
    """Where a launcher keeps the server's NCCL logs, first choice first (ops/launch-common.sh
    picks the same: ``HSFARM_NCCL_LOG_DIR``, else /var/log/hsfarm when it may write there, else
    the temp dir)."""
    if environ.get(LOG_DIR_VARIABLE):
        return [Path(environ[LOG_DIR_VARIABLE])]
    tmp = Path(environ.get("TMPDIR") or "/tmp")
    return [Path(f"/var/log/hsfarm/nccl-{port}"), tmp / f"hsfarm-nccl-{port}"]


def read_dir(log_dir: Path) -> Setup:
    """Every NCCL debug file of ``log_dir`` (``NCCL_DEBUG_FILE``'s, one per process)."""
    lines: list[str] = []
    for path in sorted(log_dir.glob("*")):
        if path.is_file():
            lines += path.read_text(errors="replace").splitlines()
    return parse(lines)


def tuning(environ: dict[str, str]) -> dict[str, str]:
    """The NCCL settings a person gave (passed to the server as they are)."""
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(TUNING_PREFIX) and k not in DEBUG_VARIABLES}


def build_parser(prog: str = "python -m sglang_patch nccl") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="What NCCL chose for the server (its "
                                "NCCL_DEBUG_FILE logs): OK, or WARN with the fix")
    p.add_argument("--log-dir", type=Path, required=True)
    return p


def main(argv: list[str] | None = None, prog: str = "python -m sglang_patch nccl") -> int:
    """``nccl --log-dir D``: one OK/WARN line for the NCCL setup the server's logs show; exit 0
    (a slow ring is a warning: the farm is right, only slow), 2 when the dir is missing."""
    args = build_parser(prog).parse_args(argv)
    if not args.log_dir.is_dir():
        print(f"FAIL  NCCL: no log dir {args.log_dir}")
        return 2
    level, text = verdict(read_dir(args.log_dir))
    print(f"{level:<5} {text}")
    return 0
