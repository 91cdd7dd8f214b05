"""The output dir's record of the data files enqueued: what restores the run's record in Redis.

Each complete ``enqueue`` of a file writes a fresh token into Redis (``ENQUEUED``), after every
sample was registered and published, then durably into ``<out>/enqueued.json``. Redis's AOF
keeps a prefix of its writes, so a matching token means the whole enqueue survived; a missing
or different one makes the reconciler run ``enqueue`` of that file again. An ``enqueue --limit
N`` is restored with its limit (the widest enqueue of a file is kept).
Test: tests/state/test_reconciler.py::test_the_output_dir_tells_which_enqueues_redis_lost."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from worker.core import durable, outdir
from worker.state import keys
from worker.state.broker import Client, redis_errors


@dataclass(frozen=True)
class Entry:
    path: str
    token: str
    limit: int | None = None  # enqueued with ``--limit``: only the first ``limit`` records


def new_token() -> str:
    return uuid.uuid4().hex


def read(out_dir: Path) -> list[Entry]:
    """The data files the output dir says were enqueued completely, with their tokens."""
    try:
        body = json.loads((out_dir / outdir.ENQUEUED_JSON).read_text())
        limits = body.get("limits", {})
        return [Entry(p, str(t), None if limits.get(p) is None else int(limits[p]))
                for p, t in body["files"].items()]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []  # unreadable: nothing to restore from (enqueue writes it anew)


@redis_errors
def record(r: Client, run_id: str, out_dir: Path, path: str,
           limit: int | None = None) -> None:
    """After a complete enqueue of ``path`` (of its first ``limit`` records, if given): its
    token into Redis, then onto the disk."""
    token = new_token()
    r.hset(keys.run_key(run_id, keys.ENQUEUED), path, token)
    entries = {e.path: e for e in read(out_dir)}
    entries[path] = Entry(path, token, _widest(entries.get(path), limit))
    files = {p: e.token for p, e in entries.items()}
    limits = {p: e.limit for p, e in entries.items() if e.limit is not None}
    durable.write_json(out_dir / outdir.ENQUEUED_JSON, {"files": files, "limits": limits})


def _widest(before: Entry | None, limit: int | None) -> int | None:
    """The limit that covers both this enqueue and the one recorded ``before`` (None: all)."""
    if before is None:
        return limit
    if before.limit is None or limit is None:
        return None
    return max(before.limit, limit)


@redis_errors
def not_in_redis(r: Client, run_id: str, out_dir: Path) -> list[Entry]:
    """Data files whose last complete enqueue Redis no longer holds in full."""
    entries = read(out_dir)
    if not entries:
        return []
    held = r.hmget(keys.run_key(run_id, keys.ENQUEUED), [e.path for e in entries])
    return [e for e, got in zip(entries, held, strict=True)
            if got is None or (got.decode() if isinstance(got, bytes) else got) != e.token]
