"""The run: which Redis keys, queue, task ids, leases, rids and dumps are one run's own.

Runs share what a deployment shares: a Redis, a host, a dump dir, a corpus, a model config.
Nothing of one run may be taken, acknowledged, deleted or adopted by another, so everything a
run puts anywhere shared carries its run id:

- Redis keys ``hsfarm:<run id>:...`` (``keys.run_key``), leases and task ids;
- its queue, ``hsfarm.<run id>`` unless ``FARM_QUEUE`` names one;
- its rids and so its dump files (``contracts.make_rid``).

The run id is derived from the output dir's manifest: the fingerprint (what makes states
comparable), the weights identity recorded when the run began (computed from
``FARM_MODEL_PATH``'s weight files; every worker checks its own against it), and a random
nonce written once with the manifest, which tells two output dirs apart wherever each host
mounts them. Two checkpoints of one model, or two output dirs of one model, are two runs.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from sglang_patch import contracts as c
from worker.core import outdir
from worker.core.settings import Settings
from worker.state import keys

if TYPE_CHECKING:  # the training side reads run ids through the store, without Redis
    import redis

TASK_NAME = "hsfarm.extract"  # the one task; its name is in every queued message
M_RUN_NONCE = "run_nonce"  # manifest key: random, written once with the manifest
QUEUE_PREFIX = "hsfarm."
TASK_PREFIX = "hsd"  # task ids: hsd-<run id>-<publication>:<sample key> (task_id)
QUEUE_SEEN_S = 7 * 24 * 3600.0  # a run seen on a queue this recently counts as sharing it


def run_id(manifest: Mapping[str, Any]) -> str:
    """The run id of the output dir whose manifest this is (16 hex digits).

    Manifests written before the nonce existed are told apart by their creation time.
    """
    weights = manifest.get("weights")
    weights_id = str(weights.get("id", "")) if isinstance(weights, Mapping) else ""
    nonce = manifest.get(M_RUN_NONCE) or repr(manifest.get("created_at"))
    blob = json.dumps([str(manifest.get("fingerprint_id")), weights_id, str(nonce)])
    return hashlib.sha256(blob.encode()).hexdigest()[: c.RUN_ID_LEN]


def read_run_id(out_dir: Path) -> str | None:
    """The run id of ``out_dir``; None while it has no readable manifest (no run began)."""
    try:
        manifest = json.loads((out_dir / outdir.MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return run_id(manifest) if isinstance(manifest, dict) else None


def run_id_of(out_dir: Path) -> str:
    """``read_run_id``, or ``NO_RUN`` (whose keys and queue hold nothing) before any run."""
    return read_run_id(out_dir) or c.NO_RUN


def queue_for(settings: Settings, run: str) -> str:
    """The run's queue: ``FARM_QUEUE`` when set, else one of its own."""
    return settings.queue or f"{QUEUE_PREFIX}{run}"


def task_id(run_id: str, publication: int, key: str) -> str:
    """The task id of one publication of sample ``key`` in run ``run_id``.

    ``:`` never occurs in a sample key (contracts), so the publication number cannot be
    mistaken for the head of a key that starts with digits and a dash (``2024-01-x``).
    """
    return f"{TASK_PREFIX}-{run_id}-{publication}:{key}"


def run_of_task(task_id: object) -> str | None:
    """The run id a task id of ours names (``hsd-<run id>-...``); None for any other id."""
    start = len(TASK_PREFIX) + 1
    if not isinstance(task_id, str) or not task_id.startswith(f"{TASK_PREFIX}-"):
        return None
    head = task_id[start:start + c.RUN_ID_LEN + 1]
    run = head[:-1]
    return run if head.endswith("-") and c.RUN_ID_RE.match(run) else None


def sample_key_of(task: str, run_id: str) -> str | None:
    """The sample key in a task id of run ``run_id``; None for any other id.

    Ids without a publication number (``hsd-<fingerprint id>-<key>``, published before
    there was one: no ``:`` in them) still name their sample: a run enqueued by an older
    version is not published twice by a newer one.
    """
    head = f"{TASK_PREFIX}-{run_id}-"
    if not task.startswith(head) or len(task) == len(head):
        return None
    rest = task[len(head):]
    publication, sep, key = rest.partition(":")
    if not sep:
        return rest  # the older format
    return key if publication.isdigit() and key else None


def message_task_id(raw: bytes | str, unacked: bool = False) -> str | None:
    """The task id in a queued message, or in an ``unacked`` entry ([message, exchange, key])."""
    try:
        body = orjson.loads(raw)
        message = body[0] if unacked else body
        return str(message["headers"]["id"])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None


def note_queue(r: redis.Redis, queue: str, run: str, now: float | None = None) -> list[str]:
    """Record that ``run`` uses ``queue``; the other runs seen on it lately (sharing it).

    Runs that share a queue lose nothing (a worker hands another run's message back
    untouched), but each worker takes and returns the other run's messages: say so.
    """
    now = time.time() if now is None else now
    name = keys.queue_runs(queue)
    r.hset(name, run, f"{now:.0f}")
    seen = {k.decode() if isinstance(k, bytes) else k: float(v)
            for k, v in r.hgetall(name).items()}
    return sorted(k for k, at in seen.items() if k != run and now - at < QUEUE_SEEN_S)


def sharing_warning(queue: str, run: str, others: list[str]) -> str:
    """What to tell a person whose run shares its queue with other runs."""
    return (f"queue {queue!r} (FARM_QUEUE) is shared by run {run} with run(s) "
            f"{', '.join(others)}: each worker takes the other runs' messages and hands them "
            "back untouched (nothing is lost, but work slows down). Unset FARM_QUEUE so each "
            f"run gets its own queue ({QUEUE_PREFIX}<run id>), or give each run its own name")
