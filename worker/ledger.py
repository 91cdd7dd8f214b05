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
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from sglang_patch import contracts as c
from worker import keys
from worker.diskio import fsync_dir

LEDGER = "enqueued.json"


@dataclass(frozen=True)
class Entry:
    path: str
    token: str


def new_token() -> str:
    return uuid.uuid4().hex


def read(out_dir: Path) -> list[Entry]:
    """The data files the output dir says were enqueued completely, with their tokens."""
    try:
        body = json.loads((out_dir / LEDGER).read_text())
        return [Entry(p, str(t)) for p, t in body["files"].items()]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []  # unreadable: nothing to restore from (enqueue writes it anew)


def record(r: redis.Redis, run_id: str, out_dir: Path, path: str) -> None:
    """After a complete enqueue of ``path``: its token into Redis, then onto the disk."""
    token = new_token()
    r.hset(keys.run_key(run_id, keys.ENQUEUED), path, token)
    files = {e.path: e.token for e in read(out_dir)}
    files[path] = token
    final = out_dir / LEDGER
    tmp = final.with_name(f".{LEDGER}{c.TMP_MARK}{os.getpid()}")
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(out_dir)


def not_in_redis(r: redis.Redis, run_id: str, out_dir: Path) -> list[str]:
    """Data files whose last complete enqueue Redis no longer holds in full."""
    entries = read(out_dir)
    if not entries:
        return []
    held = r.hmget(keys.run_key(run_id, keys.ENQUEUED), [e.path for e in entries])
    return [e.path for e, got in zip(entries, held, strict=True)
            if got is None or (got.decode() if isinstance(got, bytes) else got) != e.token]
