"""What the dashboard shows: the run's history from the index, plus series it samples itself.

Progress, throughput and failures over time come from the index's timestamps (the ``done``
zset's scores, the ``at`` of each failed/rejected outcome), so the plots are whole even when
the dashboard starts on day two. Free space, server health, broker depth, ETA and workers
exist only as "now": the dashboard samples them every ``sample_s`` and keeps the last
``MAX_SAMPLES`` in memory (a restart of the dashboard starts these series anew).
"""

from __future__ import annotations

import bisect
import os
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_dump.fingerprint import Fingerprint
from producer.stall import redis_stall, run_state
from producer.status import Status, read_status
from worker.core import run as runs
from worker.core.diskio import free_bytes
from worker.core.settings import Settings
from worker.state import broker, keys, owners
from worker.state.broker import Client
from worker.state.index import RunIndex

HISTORY_POINTS = 300  # points of the progress and throughput plots, whatever the run's length
MAX_SAMPLES = 8640  # sampled points kept: a day at the default 10 s
SAMPLES_SHOWN = 1000  # of which the page gets at most this many (evenly spread, the last too)
# throughput at a point: the average over the last tenth of the run (at most a minute), and
# over at least five grid steps, so a point is not noise and a short run's plot not a smear
RATE_WINDOW_MAX_S = 60.0
SAMPLED = ("eta_s", "output_free_bytes", "dump_free_bytes", "dump_used_bytes", "server_up",
           "server_latency_s", "queued", "unacked", "running", "retrying", "workers", "paused")


# a request id of ours (rids.RID_RE without its anchors): names the sample, whatever its key
_RID = re.compile(r"hsd-[A-Za-z0-9_.\-]+?-a\d+-n\d+")


def reason_class(reason: str) -> str:
    """A failure reason without its sample-specific parts (request ids, numbers), to group
    failures by kind."""
    return re.sub(r"\d+(\.\d+)?", "N", _RID.sub("<request>", reason.strip()))[:120]


@dataclass
class DoneHistory:
    """The ``done`` zset (key -> time) and the files' sizes, read incrementally."""

    at: dict[str, float] = field(default_factory=dict)
    size: dict[str, int] = field(default_factory=dict)

    def refresh(self, index: RunIndex) -> None:
        since = max(self.at.values(), default=0.0) - 5.0  # a margin for clock skew of hosts
        self._merge(index, index.done_between(since))
        if index.done_count() != len(self.at):  # removed, or added with older times
            self.at.clear()
            self._merge(index, index.done_between("-inf"))

    def _merge(self, index: RunIndex, entries: list[tuple[str, float]]) -> None:
        unseen = [k for k, _ in entries if k not in self.size]
        for i in range(0, len(unseen), 5000):
            part = unseen[i : i + 5000]
            sizes = index.file_sizes(part)
            self.size.update({k: int(v or 0) for k, v in zip(part, sizes, strict=True)})
        self.at.update(dict(entries))


def thinned(points: list[dict[str, Any]], at_most: int) -> list[dict[str, Any]]:
    """Every k-th point, so that at most ``at_most`` remain, always with the newest."""
    if len(points) <= at_most:
        return points
    stride = -(-len(points) // (at_most - 1))
    return points[-1::-stride][::-1]


def _cumulative(times: list[float], grid: list[float]) -> list[int]:
    return [bisect.bisect_right(times, t) for t in grid]


def history(done: DoneHistory, failed_at: list[float], rejected_at: list[float],
            start: float, now: float) -> dict[str, list[Any]]:
    """Progress (cumulative done/failed/rejected) and throughput (samples/s, bytes/s) on an
    even time grid from ``start`` to ``now``."""
    span = max(now - start, 1.0)
    step = span / (HISTORY_POINTS - 1)
    grid = [start + i * step for i in range(HISTORY_POINTS)]
    order = sorted(done.at.items(), key=lambda kv: kv[1])
    times = [t for _, t in order]
    cum_bytes = [0]
    for key, _ in order:
        cum_bytes.append(cum_bytes[-1] + done.size.get(key, 0))
    window = max(5 * step, min(RATE_WINDOW_MAX_S, span / 10))
    rate, byte_rate = [], []
    for t in grid:
        lo, hi = bisect.bisect_right(times, t - window), bisect.bisect_right(times, t)
        width = max(min(window, t - start), 1.0)
        rate.append((hi - lo) / width)
        byte_rate.append((cum_bytes[hi] - cum_bytes[lo]) / width)
    return {"t": grid, "done": _cumulative(times, grid),
            "failed": _cumulative(sorted(failed_at), grid),
            "rejected": _cumulative(sorted(rejected_at), grid),
            "samples_per_s": rate, "bytes_per_s": byte_rate}


def _outcome_times(index: RunIndex, name: str) -> list[float]:
    return [float(b.get("at", 0)) for b in index.outcomes(name).values()]


def failures_by_reason(index: RunIndex) -> list[dict[str, Any]]:
    """Failed, rejected and retrying samples grouped by kind and reason (numbers blanked)."""
    groups: Counter[tuple[str, str]] = Counter()
    example: dict[tuple[str, str], str] = {}
    for kind in (keys.FAILED, keys.REJECTED, keys.RETRYING):
        for key, body in index.outcomes(kind).items():
            g = (kind, reason_class(str(body.get("reason", ""))))
            groups[g] += 1
            example.setdefault(g, key)
    return [{"kind": kind, "reason": reason, "count": n, "example": example[(kind, reason)]}
            for (kind, reason), n in groups.most_common()]


def _free(path: Path) -> int | None:
    try:
        return free_bytes(path)
    except OSError:
        return None


def _used(path: Path) -> int | None:
    try:
        s = os.statvfs(path)
    except OSError:
        return None
    return (s.f_blocks - s.f_bfree) * s.f_frsize


def disk_notes(out_dir: Path, dump_dir: Path) -> list[str]:
    """Why a disk's free space is not plotted: its directory is not on this machine."""
    return [f"No {what} free space: {path} does not exist on this machine (the dashboard "
            f"plots the disks of the host it runs on; {var} names the directory)."
            for what, path, var in (("output dir", out_dir, "FARM_OUTPUT_DIR"),
                                    ("dump dir", dump_dir, "FARM_DUMP_DIR"))
            if not path.is_dir()]


class Sampler:
    """Samples the run every ``sample_s`` and holds what the page and /metrics serve."""

    def __init__(self, settings: Settings, fingerprint: Fingerprint) -> None:
        self.settings = settings
        self.fingerprint = fingerprint
        self.r: Client = broker.client(settings, socket_timeout_s=10.0)
        self.index = RunIndex(self.r, runs.run_id_of(settings.output_dir))
        self.done = DoneHistory()
        self.samples: deque[dict[str, Any]] = deque(maxlen=MAX_SAMPLES)
        self.snapshot: dict[str, Any] = {}
        self.status: Status | None = None
        self.error: str | None = None  # why the last sample failed (Redis away), shown on the page

    def sample(self, server: dict[str, Any]) -> dict[str, Any]:
        """Read everything once (blocking: run it in a thread); returns the new snapshot."""
        now = time.time()
        st = read_status(self.settings, self.fingerprint)
        # the run begins with its manifest, maybe after the dashboard started
        self.index = RunIndex(self.r, runs.run_id_of(self.settings.output_dir))
        self.done.refresh(self.index)
        out_dir, dump_dir = Path(self.settings.output_dir), Path(self.settings.dump_dir)
        heartbeats = owners.alive(self.r)
        point = {"t": now, "eta_s": st.eta_s, "output_free_bytes": _free(out_dir),
                 "dump_free_bytes": _free(dump_dir), "dump_used_bytes": _used(dump_dir),
                 "server_up": 1 if server.get("up") else 0,
                 "server_latency_s": server.get("latency_s"), "queued": st.queued,
                 "unacked": st.unacked, "running": st.running, "retrying": st.retrying,
                 "workers": len(heartbeats), "paused": len(st.paused)}
        self.samples.append(point)
        started = self.index.meta().get("started_at")
        first = min(self.done.at.values(), default=now)
        start = min(float(started) if started else first, now)
        # a finished run's plots end at its last outcome (elapsed is measured to it)
        end = start + st.elapsed_s if st.finished and st.elapsed_s is not None else now
        self.status = st
        shown = thinned(list(self.samples), SAMPLES_SHOWN)
        self.snapshot = {
            "run": self.index.run_id, "now": now, "status": st.to_json(),
            "history": history(self.done, _outcome_times(self.index, keys.FAILED),
                               _outcome_times(self.index, keys.REJECTED), start, max(end, start)),
            "sampled": {name: [p[name] for p in shown] for name in ("t", *SAMPLED)},
            "failures": failures_by_reason(self.index),
            "workers": self._workers(heartbeats),
            "server": server, "disks": {"output": str(out_dir), "dump": str(dump_dir),
                                        "notes": disk_notes(out_dir, dump_dir)},
        }
        self.error = None
        return self.snapshot

    def redis_away(self, e: Exception) -> None:
        """Redis did not answer: say so, keep the last figures, and show an unfinished run as
        stalled on Redis (no worker can take or record a sample without it)."""
        where = broker.where(self.settings)
        shown = "the figures are from the last good sample" if self.snapshot else "no figures yet"
        self.error = (f"Redis at {where} did not answer ({e}); {shown}. Is Redis running, is "
                      "REDIS_URL right?")
        if not self.snapshot or self.snapshot["status"]["finished"]:
            return
        stall = redis_stall(where, str(e)).to_json()
        st = {**self.snapshot["status"], "stall": stall, "eta_s": None}
        self.snapshot = {**self.snapshot, "status": {
            **st, "state": run_state(st["finished"], stall, bool(st["paused"]))}}

    def _workers(self, heartbeats: list[str]) -> list[dict[str, Any]]:
        """Each live worker main process (heartbeat), and what each process runs or waits on."""
        running = self.index.outcomes(keys.RUNNING)
        paused = self.index.outcomes(keys.PAUSED)
        rows = [{"process": h, "kind": "worker (heartbeat)", "detail": ""} for h in heartbeats]
        rows += [{"process": str(b.get("worker")), "kind": "running",
                  "detail": f"{key} attempt {b.get('attempt')} for "
                            f"{time.time() - float(b.get('since', time.time())):.0f}s"}
                 for key, b in sorted(running.items())]
        rows += [{"process": p, "kind": "paused", "detail": str(b.get("reason"))}
                 for p, b in sorted(paused.items())]
        return rows
