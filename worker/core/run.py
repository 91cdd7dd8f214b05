"""The run: which Redis keys, queue, task ids, leases, rids and dumps are one run's own.

Runs share a deployment's Redis, hosts, dump dir, corpus and model config, so everything a run
puts anywhere shared carries its run id: keys ``hsfarm:<run id>:...``, leases, task ids, the
queue ``hsfarm.<run id>`` (unless ``FARM_QUEUE``), rids and so dump files. The run id comes from
the manifest: the fingerprint, the weights identity and a nonce written once, so two checkpoints
of one model, or two output dirs wherever each host mounts them, are two runs. Test:
tests/unit/test_run.py::test_the_run_id_tells_apart_checkpoints_output_dirs_and_fingerprints."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from engine_dump.rids import NO_RUN, RUN_ID_LEN, RUN_ID_RE
from worker.core import manifest as manifests
from worker.core.errors import ConfigError
from worker.core.settings import Settings

TASK_NAME = "hsfarm.extract"  # the one task; its name is in every queued message
QUEUE_PREFIX = "hsfarm."
TASK_PREFIX = "hsd"  # task ids: hsd-<run id>-<publication>:<sample key> (task_id)
TASK_NAME = "hsfarm.extract"  # the one task; its name and message body outlive upgrades


def run_id(manifest: Mapping[str, Any]) -> str:
    """The run id of the output dir whose manifest this is (16 hex digits).

    Manifests written before the nonce existed are told apart by their creation time.
    """
    weights = manifests.recorded_weights(manifest)
    weights_id = str(weights.get("id", "")) if weights is not None else ""
    nonce = manifest.get(manifests.M_RUN_NONCE) or repr(manifest.get(manifests.M_CREATED))
    blob = json.dumps([str(manifest.get(manifests.M_FINGERPRINT_ID)), weights_id, str(nonce)])
    return hashlib.sha256(blob.encode()).hexdigest()[: RUN_ID_LEN]


def read_run_id(out_dir: Path) -> str | None:
    """The run id of ``out_dir``; None while it has no readable manifest (no run began)."""
    try:
        return run_id(manifests.read(out_dir))
    except (OSError, ConfigError):
        return None


def run_id_of(out_dir: Path) -> str:
    """``read_run_id``, or ``NO_RUN`` (whose keys and queue hold nothing) before any run."""
    return read_run_id(out_dir) or NO_RUN


def queue_for(settings: Settings, run: str) -> str:
    """The run's queue: ``FARM_QUEUE`` when set, else one of its own."""
    return settings.queue or f"{QUEUE_PREFIX}{run}"


def task_id(run_id: str, publication: int, key: str) -> str:
    """The task id of one publication of sample ``key`` in run ``run_id``.

    ``:`` never occurs in a sample key (engine_dump/rids.py), so the publication number cannot be
    mistaken for the head of a key that starts with digits and a dash (``2024-01-x``).
    """
    return f"{TASK_PREFIX}-{run_id}-{publication}:{key}"


def run_of_task(task_id: object) -> str | None:
    """The run id a task id of ours names (``hsd-<run id>-...``); None for any other id."""
    start = len(TASK_PREFIX) + 1
    if not isinstance(task_id, str) or not task_id.startswith(f"{TASK_PREFIX}-"):
        return None
    head = task_id[start:start + RUN_ID_LEN + 1]
    run = head[:-1]
    return run if head.endswith("-") and RUN_ID_RE.match(run) else None


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
