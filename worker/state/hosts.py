"""The hosts of one run: who they are, where their output is, whether they live, what they hold.

A run may span several server hosts (``FARM_HOST_ID``), each with its own server, dump dir
and output dir (or a shared one), on one ``REDIS_URL``; their entries, heartbeats and holdings
are keys of the run (keys.py). Redis may lose all of it: a host's workers register what their
output dir holds at start and when their entry is gone; each output dir keeps ``hosts.json``,
so ``enqueue`` waits for the hosts it has not heard from. Test: tests/farm/test_hosts.py::
test_after_redis_lost_everything_enqueue_waits_for_the_hosts_it_has_not_heard_from."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_dump.dumpfile import DUMP_SUFFIX, T_INPUT_IDS, is_temp_name
from engine_dump.fingerprint import Fingerprint
from worker.core import durable, finalfile, liveness, outdir, tensorfile
from worker.core import manifest as manifests
from worker.core.errors import ConfigError, Corrupt
from worker.core.settings import Settings
from worker.state import keys
from worker.state.broker import Client, redis_errors
from worker.state.index import RunIndex, as_text

BATCH = 1000
HEADER_THREADS = 8


def host_id(settings: Settings) -> str:
    """This host's name in the run: ``FARM_HOST_ID``, or the hostname."""
    return settings.host_id or liveness.HOST


def _k(run_id: str, name: str) -> str:
    return keys.run_key(run_id, name)


@dataclass(frozen=True)
class Held:
    """One final file of this host's output dir, as registered."""

    key: str
    sha256: str
    size_bytes: int
    tokens: int
    mtime: float
    path: Path


def _final_files(out_dir: Path) -> Iterator[Path]:
    """Final files under ``out_dir/samples/<shard>/`` (no temp files), by directory listing."""
    samples = out_dir / outdir.SAMPLES_DIR
    if not samples.is_dir():
        return
    for shard in os.scandir(samples):
        if not shard.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(shard.path):
            if entry.name.endswith(DUMP_SUFFIX) and not is_temp_name(entry.name):
                yield Path(entry.path)


def _held(path: Path, fingerprint_id: str, fp: Fingerprint | None) -> Held | None:
    """The file's registration from its header (not its data); None for a file of another
    run, one not in the run's layout (``fp``'s dtypes and shapes, when the manifest names
    them) or one that does not parse (``audit`` names those)."""
    try:
        head = tensorfile.read_header(path)
        mtime = path.stat().st_mtime
    except (OSError, Corrupt):
        return None
    meta = head.metadata
    if meta.get(finalfile.M_FINGERPRINT) != fingerprint_id or not meta.get(finalfile.M_KEY):
        return None
    if fp is not None and finalfile.shape_problems(fp, head):
        return None
    tokens = head.shapes.get(T_INPUT_IDS, (0,))[0]
    return Held(meta[finalfile.M_KEY], meta.get(finalfile.M_CONTENT, ""), head.size_bytes, tokens,
                mtime, path)


def scan(out_dir: Path, fingerprint_id: str) -> Iterator[Held]:
    """Every final file of the run in ``out_dir``: headers read in parallel (a cold disk
    waits on I/O), never tensor data: ~37k files take seconds."""
    fp = _run_fingerprint(out_dir, fingerprint_id)
    with ThreadPoolExecutor(max_workers=HEADER_THREADS) as pool:
        for held in pool.map(lambda p: _held(p, fingerprint_id, fp), _final_files(out_dir),
                             chunksize=64):
            if held is not None:
                yield held


def _run_fingerprint(out_dir: Path, fingerprint_id: str) -> Fingerprint | None:
    """The fingerprint the output dir's manifest records, when it is run ``fingerprint_id``'s."""
    try:
        fp = manifests.fingerprint(manifests.read(out_dir))
    except (OSError, ConfigError):
        return None
    return fp if fp.id == fingerprint_id else None


@dataclass
class Registration:
    files: int = 0
    relearnt: int = 0  # done again in the index (Redis had lost them)
    twice: int = 0  # also held by another host
    set_aside: int = 0  # of those, the same record, done there: moved to done-elsewhere/ here


@redis_errors
def register(r: Client, run_id: str, host: str, out_dir: Path, fingerprint_id: str,
             settings: Settings) -> Registration:
    """Say in Redis what this host's output dir holds: each file's key is held by this host
    (unless another host claimed it first: then it is held twice), done in the run's index.
    A file of the same record that the run already records as done on another host (this
    host was lost after writing it, before the run learnt so, and the sample was done again
    there) is moved to ``done-elsewhere/`` in this output dir: kept, never deleted, out of the
    training set, so each sample is in one place.
    Then the entry's ``registered_at``: the host has been heard from."""
    index, reg = RunIndex(r, run_id), Registration()
    _announce(r, run_id, host, out_dir)
    batch: list[Held] = []
    for held in scan(out_dir, fingerprint_id):
        batch.append(held)
        if len(batch) >= BATCH:
            _register_batch(r, index, run_id, host, batch, reg, out_dir)
            batch = []
    _register_batch(r, index, run_id, host, batch, reg, out_dir)
    beat(r, run_id, host, out_dir, settings, registered_files=reg.files)
    remember_hosts(r, run_id, out_dir)
    return reg


def _announce(r: Client, run_id: str, host: str, out_dir: Path) -> None:
    """The host's output dir in its entry before its files are registered: a host that shares
    this mount with one registered before is then seen as the same output (``same_output``),
    and the files they share are never taken for a second copy and set aside."""
    old = entry(r, run_id, host) or {}
    r.hset(_k(run_id, keys.HOSTS), host,
           json.dumps({**old, "output_dir": str(out_dir), "root_id": root_id(out_dir)}))


def _register_batch(r: Client, index: RunIndex, run_id: str, host: str, batch: list[Held],
                    reg: Registration, out_dir: Path) -> None:
    if not batch:
        return
    names = [h.key for h in batch]
    p = r.pipeline(transaction=False)
    for h in batch:
        p.hsetnx(_k(run_id, keys.HELD), h.key, f"{host}|{h.sha256}")
    p.hmget(_k(run_id, keys.HELD), names)
    for name in names:
        p.zscore(_k(run_id, keys.DONE), name)
    out = p.execute()
    holders = out[len(batch)]
    done = out[len(batch) + 1:]
    twice: dict[Any, str] = {}
    shared = {host: True}
    aside: set[str] = set()
    for h, holder, d in zip(batch, holders, done, strict=True):
        other, sha = as_text(holder).split("|", 1) if holder is not None else (host, h.sha256)
        if other not in shared:
            shared[other] = same_output(r, run_id, other, host)
        if shared[other]:
            continue
        entry_ = {"hosts": sorted({other, host}), "kept": other}
        if sha == h.sha256 and d is not None:
            entry_["set_aside"] = f"{host}:{_set_aside(out_dir, h.path)}"
            aside.add(h.key)
        twice[h.key] = json.dumps(entry_)
    if twice:
        r.hset(_k(run_id, keys.HELD_TWICE), mapping=twice)
    # a header is not enough for a sample an attempt found damaged or is redoing: that
    # attempt, or enqueue (which then reads the whole file), decides
    doubted = index.in_question(names)
    relearn = {h.key: (h.size_bytes, h.tokens)
               for h, d, doubt in zip(batch, done, doubted, strict=True)
               if d is None and h.key not in aside and not doubt}
    index.mark_done_many(relearn, {h.key: h.mtime for h in batch if h.key in relearn})
    reg.files += len(batch) - len(aside)
    reg.relearnt += len(relearn)
    reg.twice += len(twice)
    reg.set_aside += len(aside)


def _set_aside(out_dir: Path, path: Path) -> Path:
    """Move a final file out of ``samples/`` into ``done-elsewhere/`` (same file system)."""
    dest = out_dir / outdir.DONE_ELSEWHERE_DIR / path.name
    dest.parent.mkdir(exist_ok=True)
    durable.move(path, dest)
    return dest


@redis_errors
def same_output(r: Client, run_id: str, a: str, b: str) -> bool:
    """Hosts ``a`` and ``b`` write to one output dir (a shared mount: one root id)."""
    ea, eb = entry(r, run_id, a), entry(r, run_id, b)
    return bool(ea and eb and ea.get("root_id") and ea.get("root_id") == eb.get("root_id"))


def root_id(out_dir: Path) -> str:
    """The output dir's own id: hosts that share one mount see the same."""
    path = out_dir / outdir.ROOT_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        durable.write_new_bytes(path, os.urandom(8).hex().encode())  # a concurrent writer's wins
        return path.read_text().strip()


@redis_errors
def entry(r: Client, run_id: str, host: str) -> dict[str, Any] | None:
    raw = r.hget(_k(run_id, keys.HOSTS), host)
    return None if raw is None else dict(json.loads(raw))


@redis_errors
def hosts(r: Client, run_id: str) -> dict[str, dict[str, Any]]:
    """Every host the run's Redis knows: host id -> entry."""
    raw: dict[bytes, bytes] = r.hgetall(_k(run_id, keys.HOSTS))  # type: ignore[assignment]
    return {as_text(k): json.loads(v) for k, v in raw.items()}


@redis_errors
def beat(r: Client, run_id: str, host: str, out_dir: Path, settings: Settings,
         registered_files: int | None = None) -> bool:
    """Refresh this host's entry (its heartbeat and its server's state). Returns False when
    the entry was never registered (Redis lost it, or this is the first start): then the
    caller registers the host's files."""
    old = entry(r, run_id, host) or {}
    old.pop("stopped_at", None)  # a process of the host beats: it runs (again)
    new = {**old, "machine": liveness.MACHINE, "output_dir": str(out_dir),
           "root_id": root_id(out_dir), "server_url": settings.server_url,
           "server": server_state(settings.server_url), "at": time.time()}
    if registered_files is not None:
        new.update(registered_at=time.time(), files=registered_files)
    r.hset(_k(run_id, keys.HOSTS), host, json.dumps(new))
    return "registered_at" in new


@redis_errors
def mark_stopped(r: Client, run_id: str, host: str) -> None:
    """A worker of ``host`` stopped cleanly: the host shows as stopped, not lost, until a
    process of it beats again (another worker of the host, within one reaper interval)."""
    old = entry(r, run_id, host)
    if old is not None:
        r.hset(_k(run_id, keys.HOSTS), host, json.dumps({**old, "stopped_at": time.time()}))


def server_state(url: str, timeout_s: float = 2.0) -> str:
    """"ok", or what is wrong with the server at ``url`` (its ``/health``)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as resp:
            return "ok" if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, ValueError) as e:
        return f"down ({type(e).__name__})"


@redis_errors
def claim(r: Client, run_id: str, host: str, shas: dict[str, str]) -> None:
    """``host`` holds these keys' files (key -> content sha), unless another claimed them."""
    items = list(shas.items())
    for i in range(0, len(items), BATCH):
        p = r.pipeline(transaction=False)
        for key, sha in items[i : i + BATCH]:
            p.hsetnx(_k(run_id, keys.HELD), key, f"{host}|{sha}")
        p.execute()


@redis_errors
def holders(r: Client, run_id: str, sample_keys: list[str]) -> list[tuple[str, str] | None]:
    """(host, content sha) holding each key's file, or None."""
    if not sample_keys:
        return []
    raw = r.hmget(_k(run_id, keys.HELD), sample_keys)
    return [None if x is None else tuple(as_text(x).split("|", 1)) for x in raw]  # type: ignore[misc]


@redis_errors
def holder(index: RunIndex, key: str) -> tuple[str, str] | None:
    """(host, content sha) of the host holding ``key``'s file, or None; Redis errors as
    ``Transient``."""
    return holders(index.r, index.run_id, [key])[0]


@redis_errors
def held_counts(r: Client, run_id: str) -> dict[str, int]:
    """Host -> how many samples' files it holds."""
    counts: dict[str, int] = {}
    for _, v in r.hscan_iter(_k(run_id, keys.HELD), count=5000):
        host = as_text(v).split("|", 1)[0]
        counts[host] = counts.get(host, 0) + 1
    return counts


@redis_errors
def held_twice(r: Client, run_id: str) -> dict[str, dict[str, Any]]:
    raw: dict[bytes, bytes] = r.hgetall(_k(run_id, keys.HELD_TWICE))  # type: ignore[assignment]
    return {as_text(k): json.loads(v) for k, v in raw.items()}


# --- what survives a Redis that lost everything: hosts.json in each output dir -------------


@redis_errors
def remember_hosts(r: Client, run_id: str, out_dir: Path) -> None:
    """Write the run's hosts (as Redis knows them now, and as this dir knew them) into
    ``out_dir/hosts.json``, durably, when that changes what it says."""
    known = read_known(out_dir)
    now = {h: {"output_dir": e.get("output_dir", ""), "root_id": e.get("root_id", "")}
           for h, e in hosts(r, run_id).items()}
    merged = {**known, **now}
    if merged == known:
        return
    durable.write_json(out_dir / outdir.HOSTS_JSON, merged)


def read_known(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The hosts ``out_dir`` has known in this run (empty: none recorded)."""
    try:
        data = json.loads((out_dir / outdir.HOSTS_JSON).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def forget_hosts(out_dir: Path, names: Iterable[str]) -> None:
    """Drop ``names`` from ``out_dir/hosts.json``, durably (their samples are to be redone)."""
    known = read_known(out_dir)
    for name in names:
        known.pop(name, None)
    durable.write_json(out_dir / outdir.HOSTS_JSON, known)


@redis_errors
def unheard(r: Client, run_id: str, out_dir: Path) -> dict[str, dict[str, Any]]:
    """Hosts ``out_dir`` knows in this run that have not registered their files in this
    Redis (Redis lost them, and their workers have not started since): host -> what is known."""
    registered = {h for h, e in hosts(r, run_id).items() if "registered_at" in e}
    return {h: e for h, e in read_known(out_dir).items() if h not in registered}


# --- per host, for status, the dashboard and /metrics ------------------------------------


def rate_window(first_done_at: float, until: float, window_s: float) -> tuple[float, float]:
    """(since, span_s): what a rate is measured over, up to ``until`` (now, or a finished
    run's last outcome): the last ``window_s``, or since the first completion while the run is
    younger than that. The run's rate (``status``) and each host's use this one rule."""
    since = max(first_done_at, until - window_s)
    return since, max(until - since, 1.0)


@redis_errors
def per_host(r: Client, run_id: str, heartbeat_ttl_s: float,
             window_s: float = 300.0, until: float | None = None) -> list[dict[str, Any]]:
    """Per host: output dir, state, heartbeat age, server state, done there, running, rate,
    when a worker of it last started.

    ``until``: a finished run's last outcome (None while it runs): rates stop there, and a
    host whose heartbeat was fresh then is "stopped" (after the finish), not "lost".
    """
    now = time.time()
    entries = hosts(r, run_id)
    held = held_counts(r, run_id)
    running: dict[str, int] = {}
    for v in r.hvals(_k(run_id, keys.RUNNING)):
        worker = str(json.loads(v).get("worker", ""))
        name = worker.rsplit(":", 1)[0]
        running[name] = running.get(name, 0) + 1
    by_host, span_s = _done_per_host(r, run_id, window_s, until or now)
    out = []
    for name in sorted(set(entries) | set(held) | set(running)):
        e = entries.get(name, {})
        age = now - float(e["at"]) if "at" in e else None
        stopped = "stopped_at" in e  # its workers stopped cleanly
        alive = age is not None and age < heartbeat_ttl_s and not stopped
        at_finish = until is not None and "at" in e and until - float(e["at"]) < heartbeat_ttl_s
        out.append({"host": name, "output_dir": e.get("output_dir", "?"),
                    "alive": alive,
                    "state": "alive" if alive else "stopped" if stopped or at_finish else "lost",
                    "heartbeat_age_s": age, "server": e.get("server", "unknown"),
                    "registered_at": e.get("registered_at"),  # its newest worker's start
                    "done": held.get(name, 0), "running": running.get(name, 0),
                    "rate_per_s": by_host.get(name, 0) / span_s if span_s else 0.0})
    return out


def _done_per_host(r: Client, run_id: str, window_s: float,
                   until: float) -> tuple[dict[str, int], float]:
    """Samples done per host in the rate's window (``rate_window``), and its span."""
    first = r.zrange(_k(run_id, keys.DONE), 0, 0, withscores=True)
    if not first:
        return {}, 0.0
    since, span_s = rate_window(float(first[0][1]), until, window_s)
    members: list[bytes] = r.zrange(  # type: ignore[assignment]
        _k(run_id, keys.DONE), since, until, byscore=True)
    by_host: dict[str, int] = {}
    for hd in holders(r, run_id, [as_text(k) for k in members]):
        if hd is not None:
            by_host[hd[0]] = by_host.get(hd[0], 0) + 1
    return by_host, span_s
