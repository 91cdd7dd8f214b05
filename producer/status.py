"""``status``: where a run stands, from the Redis index and the broker.

Needs neither the inference server nor ``FARM_MODEL_PATH`` once the output dir has its
manifest (which names the run): ``status`` is what a person runs while the server is down.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine_dump.fingerprint import Fingerprint
from producer import stall as stalls
from worker.core import liveness, outdir
from worker.core import manifest as manifests
from worker.core import run as runs
from worker.core.errors import ConfigError, environmental_rejection
from worker.core.settings import Settings, with_generation
from worker.server.admission import Admission, limits_for_host
from worker.server.fingerprint import run_fingerprint
from worker.state import broker, hosts, keys
from worker.state.broker import Client
from worker.state.corpus import Corpus
from worker.state.index import RunIndex
from worker.state.queue_scan import broker_depth

SHOW_KEYS = 20  # sample keys listed by name where only the count would be too little
BYTES_WINDOW_MAX = 5000  # newest completions whose sizes make bytes/s (one HMGET)


@dataclass(frozen=True)
class Status:
    total: int
    done: int
    queued: int
    unacked: int
    running: int
    retrying: int
    failed: int
    rejected: int
    stale: int
    bytes: int
    tokens: int
    rate_per_s: float
    eta_s: float | None
    bytes_per_s: float = 0.0
    rate_window_s: float = 0.0  # what the rate was measured over (shorter early in a run)
    elapsed_s: float | None = None  # since the first enqueue; to the last outcome when finished
    # key -> {attempt, reason, at}: samples whose last attempt failed and that will be retried
    retrying_samples: dict[str, dict[str, Any]] = field(default_factory=dict)
    # process -> {reason, at}: processes waiting out the environment (low disk, server down)
    paused: dict[str, dict[str, Any]] = field(default_factory=dict)
    pruned_running: int = 0  # entries of attempts that no longer run, removed just now
    # lost task messages the run published again by itself (worker/steps/reconciler.py): how many
    # times in all, and the newest few sample keys
    republished: int = 0
    republished_samples: list[str] = field(default_factory=list)
    # this host's admission: limits, and what is held now (when the dump dir is local)
    admission: dict[str, object] = field(default_factory=dict)
    # the run's hosts (worker/state/hosts.py): per host done there, running, rate, server, heartbeat
    hosts: list[dict[str, Any]] = field(default_factory=list)
    parked: int = 0  # samples waiting for their data file to be readable (no message)
    removed: int = 0  # samples that left the run: their records left the corpus
    # fid -> {path, reason, host, at, parked}: data files a worker could not read
    unreadable: dict[str, dict[str, Any]] = field(default_factory=dict)
    # {kind, reason, fix} while the run's work waits and nothing moves (producer/stall.py)
    stall: dict[str, str] | None = None
    # samples the index calls done whose final file is gone from this host's output dir: not
    # counted in ``done`` (``enqueue`` publishes them again); how many, and the first few keys
    files_gone: int = 0
    files_gone_samples: list[str] = field(default_factory=list)
    # a regenerating run's generation in all (``RunIndex.generated``): turns, tokens, seconds
    # (its requests', summed), first_at, last_at, samples, sample_turns; None for a run that
    # does not regenerate; and when its last turn is expected (``generation_eta``)
    generation: dict[str, float] | None = None
    generation_eta_s: float | None = None
    generation_settings: dict[str, Any] | None = None  # the fingerprint's (docs/regeneration.md)

    @property
    def remaining(self) -> int:
        """Samples without an outcome (stale ones have none: their record changed)."""
        return max(self.total - self.done - self.failed - self.rejected, 0)

    @property
    def finished(self) -> bool:
        """Every sample has an outcome and nothing is in flight (and there is a run: an
        index that Redis lost reads total 0, which is not a finished run)."""
        return (self.total > 0 and self.remaining == 0 and self.queued == 0 and self.unacked == 0
                and self.running == 0 and self.retrying == 0)

    @property
    def state(self) -> str:
        """``finished``, ``stalled``, ``paused`` or ``running``."""
        return stalls.run_state(self.finished, self.stall, bool(self.paused))

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "remaining": self.remaining, "finished": self.finished,
                "state": self.state}


def status_fingerprint(settings: Settings) -> tuple[Fingerprint, str]:
    """The run's fingerprint and where it came from: the output dir's manifest when there is
    one (no server, no model files needed), else the model's files, as ``enqueue`` does.

    Raises:
        ConfigError: the manifest is unreadable, or there is none and the model cannot be found.
    """
    path = Path(settings.output_dir) / outdir.MANIFEST
    if path.is_file():
        return manifest_fingerprint(settings), str(path)
    try:
        model_path, fingerprint = run_fingerprint(settings, wait_s=5)
    except ConfigError as e:
        raise ConfigError(f"{no_run(settings)}; and without a run the model must be found: "
                          f"{e}") from e
    return fingerprint, str(model_path)


def no_run(settings: Settings) -> str:
    """Why ``settings.output_dir`` holds no run, and how to point at one."""
    out = Path(settings.output_dir)
    why = f"it has no {outdir.MANIFEST}" if out.is_dir() else "no such directory"
    return (f"no run in {out}: {why} (a run begins with its first 'python -m producer "
            "enqueue'). Set FARM_OUTPUT_DIR to the run's output dir (the demo's: demo-out/out)")


def manifest_fingerprint(settings: Settings) -> Fingerprint:
    """The run's fingerprint from its output dir's manifest.

    Raises:
        ConfigError: there is no run there (no manifest: ``no_run`` says so), or its manifest
            is unreadable.
    """
    path = Path(settings.output_dir) / outdir.MANIFEST
    if not path.is_file():
        raise ConfigError(no_run(settings))
    return manifests.fingerprint(manifests.read(settings.output_dir), path)


def run_settings(settings: Settings, fingerprint: Fingerprint) -> Settings:
    """``settings`` with the run's own storage choices from its fingerprint (dtype, layers,
    max tokens, overlong, generation): what its files are checked against, whatever the
    environment says."""
    return with_generation(
        replace(settings, store_dtype=fingerprint.dtype, max_tokens=fingerprint.max_tokens,
                overlong=fingerprint.overlong,
                layers_to_capture=tuple(fingerprint.layers_to_capture)),
        fingerprint.generation)


def read_status(settings: Settings, fingerprint: Fingerprint,
                window_s: float | None = None) -> Status:
    """Where the run stands now. ``window_s``: what the rate is measured over (default: the
    run's stall time, ``stall.stall_after_s``, so a rate of 0 while work waits is a stall)."""
    window_s = window_s or stalls.stall_after_s(settings, fingerprint)
    r = broker.client(settings)
    run_id = runs.run_id_of(settings.output_dir)
    index = RunIndex(r, run_id)
    pruned = index.prune_running(liveness.gone_here)
    index.prune_paused(liveness.gone_here, max_age_s=max(60.0, 3 * settings.pause_poll_s))
    counts = index.counts()
    gone = files_gone(settings, r, index)
    done = counts.done - len(gone)
    waiting, unacked = broker_depth(r, runs.queue_for(settings, run_id))
    remaining = max(counts.total - done - counts.failed - counts.rejected, 0)
    finished = (remaining == 0 and waiting == 0 and unacked == 0 and counts.running == 0
                and counts.retrying == 0)
    # a finished run's figures stop at its last outcome, not at the time of asking
    until = _last_outcome_at(index) if finished else None
    rate, bytes_rate, measured_s = _rates(index, window_s, until or time.time())
    started = index.meta().get("started_at")
    paused = index.outcomes(keys.PAUSED)
    # while every process with work waits out the environment, no rate predicts the end
    stalled = bool(paused) and counts.running == 0
    again = index.republished()
    st = Status(total=counts.total, done=done, queued=waiting, unacked=unacked,
                running=counts.running, retrying=counts.retrying, failed=counts.failed,
                rejected=counts.rejected, stale=counts.stale, bytes=counts.bytes,
                tokens=counts.tokens, rate_per_s=rate,
                eta_s=(remaining / rate) if rate > 0 and remaining and not stalled else None,
                bytes_per_s=bytes_rate, rate_window_s=measured_s,
                elapsed_s=None if started is None else max(
                    (until or time.time()) - float(started), 0.0),
                retrying_samples=index.outcomes(keys.RETRYING),
                paused=paused, pruned_running=pruned,
                republished=sum(again.values()), republished_samples=sorted(again)[:SHOW_KEYS],
                admission=host_admission(settings, fingerprint),
                parked=counts.parked, removed=counts.removed,
                unreadable=unreadable_files(index),
                files_gone=len(gone), files_gone_samples=gone[:SHOW_KEYS],
                hosts=hosts.per_host(r, run_id, settings.heartbeat_ttl_s, window_s,
                                     until=until),
                generation=index.generated() if fingerprint.generation else None,
                generation_settings=(json.loads(fingerprint.generation)
                                     if fingerprint.generation else None))
    st = replace(st, generation_eta_s=generation_eta(st))
    stall = run_stall(index, st, settings, fingerprint)
    return st if stall is None else replace(st, stall=stall.to_json(), eta_s=None)


def generation_eta(st: Status) -> float | None:
    """Seconds until a regenerating run's last turn is generated: the turns left (the samples
    whose generation has not ended, at the turns per sample of those whose has, less the
    turns already made of the unfinished) at the run's turns per second since its first;
    None before a sample's generation ended, or when nothing is left."""
    g = st.generation or {}
    samples, turns = g.get("samples", 0.0), g.get("turns", 0.0)
    span_s = g.get("last_at", 0.0) - g.get("first_at", 0.0)
    if not samples or span_s <= 0 or st.finished:
        return None
    per_sample = g.get("sample_turns", 0.0) / samples
    left_samples = max(st.total - samples - st.failed - st.rejected, 0.0)
    left_turns = max(left_samples * per_sample - (turns - g.get("sample_turns", 0.0)), 0.0)
    return left_turns / (turns / span_s) if left_turns else None


def unreadable_files(index: RunIndex) -> dict[str, dict[str, Any]]:
    """Data files a worker could not read, each with how many samples wait on it."""
    corpus = Corpus(index)
    per_file: dict[int, int] = {}
    for fid in corpus.parked().values():
        per_file[fid] = per_file.get(fid, 0) + 1
    return {str(fid): {**body, "parked": per_file.get(fid, 0)}
            for fid, body in sorted(corpus.unreadable().items())}


def host_admission(settings: Settings, fingerprint: Fingerprint) -> dict[str, object]:
    """This host's in-flight limit and dump budget (as its workers compute them), and what
    its workers hold now when the dump dir is on this host."""
    limits = limits_for_host(settings, fingerprint.hidden_size, timeout_s=1.0)
    out: dict[str, object] = {"max_in_flight": limits.max_in_flight,
                              "dump_budget_bytes": limits.dump_budget_bytes,
                              "limits_from": limits.source, "dp_groups": limits.dp_groups}
    if settings.dump_dir.is_dir():
        held = Admission(settings.dump_dir, limits, wait_s=0).usage()
        out.update(in_flight=held.requests, dump_bytes_held=held.dump_bytes)
    return out


def _rates(index: RunIndex, window_s: float, now: float) -> tuple[float, float, float]:
    """(samples/s, bytes/s, seconds measured over) up to ``now``, over ``hosts.rate_window``
    (so the first minutes read right, and each host's rate adds up to the run's)."""
    first = index.done_at_edge(newest=False)
    if first is None:
        return 0.0, 0.0, 0.0
    since, span_s = hosts.rate_window(first, now, window_s)
    recent = [k for k, _ in index.done_between(since, now, BYTES_WINDOW_MAX, newest_first=True)]
    n = index.done_count(since, now)
    if not recent:
        return 0.0, 0.0, span_s
    sizes = [x for x in index.file_sizes(recent) if x is not None]
    mean_bytes = sum(sizes) / max(len(sizes), 1)
    return n / span_s, n * mean_bytes / span_s, span_s


def _last_outcome_at(index: RunIndex) -> float | None:
    """When the newest done, failed or rejected outcome was recorded."""
    last = index.done_at_edge(newest=True)
    ends = [] if last is None else [last]
    for name in (keys.FAILED, keys.REJECTED):
        ends += [float(b.get("at", 0)) for b in index.outcomes(name).values()]
    return max(ends, default=None)


def files_gone(settings: Settings, r: Client, index: RunIndex) -> list[str]:
    """Samples the index calls done whose final file is not in this host's output dir (deleted
    since), and that no other host's dir holds instead. One ``stat`` per done sample: 37k take
    a fraction of a second from the page cache; the files' data is ``audit``'s to read."""
    out = Path(settings.output_dir)
    gone = sorted(k for k in index.done_keys() if not outdir.final_path(out, k).exists())
    here = hosts.host_id(settings)
    return [k for k, by in zip(gone, hosts.holders(r, index.run_id, gone), strict=True)
            if by is None or by[0] == here or hosts.same_output(r, index.run_id, by[0], here)]


def environmental_rejections(settings: Settings) -> list[tuple[str, str]]:
    """Rejected samples whose reason was an answer of the server or a gateway, not their
    content (recorded by older versions, or cut to a short server context): (key, reason).
    ``enqueue`` publishes them again."""
    index = RunIndex(broker.client(settings), runs.run_id_of(settings.output_dir))
    return sorted((key, str(body.get("reason", "")))
                  for key, body in index.outcomes(keys.REJECTED).items()
                  if environmental_rejection(str(body.get("reason", ""))))


def failure_entries(settings: Settings) -> list[dict[str, Any]]:
    """Every failed, rejected, stale and retrying sample: kind, key and body (reason, at…)."""
    index = RunIndex(broker.client(settings), runs.run_id_of(settings.output_dir))
    return [{"kind": kind, "key": key, **body}
            for kind in (keys.FAILED, keys.REJECTED, keys.STALE, keys.RETRYING)
            for key, body in sorted(index.outcomes(kind).items())]


def failures(settings: Settings) -> list[str]:
    """One line per failed, rejected, stale or retrying sample: kind, key, reason."""
    return [f"{e['kind']:8} {e['key']}: {e.get('reason')}"
            for e in failure_entries(settings)]


# --- is the run stalled? (the rule is producer/stall.py's) ------------------------------------


def run_stall(index: RunIndex, st: Status, settings: Settings,
              fingerprint: Fingerprint) -> stalls.Stall | None:
    """The run's stall from ``st`` and the index: when it last moved, what waits."""
    meta = index.meta()
    moved = [_last_outcome_at(index), *(float(meta[k]) for k in ("published_at", "started_at")
                                        if k in meta),
             *(float(h["registered_at"]) for h in st.hosts if h.get("registered_at"))]
    newest_errors = sorted(st.retrying_samples.values(), key=lambda b: -float(b.get("at", 0)))
    return stalls.judge(stalls.Signals(
        # parked and stale samples wait for a person (status says so), not for a worker
        work_waits=not st.finished and (st.remaining > st.parked + st.stale
                                        or st.queued + st.unacked > 0),
        hosts=st.hosts, paused=st.paused,
        last_moved_at=max((t for t in moved if t is not None), default=None),
        now=time.time(), stall_after_s=stalls.stall_after_s(settings, fingerprint),
        heartbeat_ttl_s=settings.heartbeat_ttl_s, running=st.running, retrying=st.retrying,
        retry_reasons=[str(b.get("reason", "")) for b in newest_errors]))
