"""The output dir's record of the data files enqueued for its run: what restores the run's
record in Redis when Redis lost it.

Each complete ``enqueue`` of a data file ends by writing a fresh token twice: into Redis
(``ENQUEUED``: path -> token), after every sample of the file was registered and published,
then into ``<out>/enqueued.json`` (temp file, fsync, rename, fsync of the dir). Redis's AOF
keeps a prefix of the writes it was sent: if the token it holds is the one on disk, every
write of that enqueue is there too. A token missing or different (a Redis that lost its last
second with ``appendfsync everysec``, or everything) means the run's record of that file
(its samples, maybe its messages) may be gone: the reconciler runs ``enqueue`` for it again,
which relearns what is done from the final files' headers and publishes the rest.

An ``enqueue --limit N`` (the first N records) is recorded with its limit, and restored as
such: the run holds the first N records of that file, not the whole of it. The widest
enqueue of a file is kept: a whole one over any limit, the larger of two limits.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from worker.core import durable, outdir
from worker.state import keys


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


def record(r: redis.Redis, run_id: str, out_dir: Path, path: str,
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


def not_in_redis(r: redis.Redis, run_id: str, out_dir: Path) -> list[Entry]:
    """Data files whose last complete enqueue Redis no longer holds in full."""
    entries = read(out_dir)
    if not entries:
        return []
    held = r.hmget(keys.run_key(run_id, keys.ENQUEUED), [e.path for e in entries])
    return [e for e, got in zip(entries, held, strict=True)
            if got is None or (got.decode() if isinstance(got, bytes) else got) != e.token]
