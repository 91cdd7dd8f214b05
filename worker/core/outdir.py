"""Every name in an output dir: the run's files, its sample files, and temp files.

``<out>/manifest.json`` (the run), ``samples/<shard>/<key>.safetensors`` (final files),
``removed/`` and ``done-elsewhere/`` (files kept aside), the run's records (``hosts.json``,
``enqueued.json``, the canary, the final norm, the training index). Temp files carry the
hook's temp mark and then the writer's ``liveness.temp_tag``, so cleanup can tell a dead
writer's from a live one's. Tests: tests/unit/test_store.py, tests/state/test_durable.py."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

from engine_dump import dumpfile
from worker.core import liveness

MANIFEST = "manifest.json"  # the run: fingerprint, weights, nonce (worker/core/run.py)
HOSTS_JSON = "hosts.json"  # the run's hosts as last seen (worker/state/hosts.py)
ENQUEUED_JSON = "enqueued.json"  # data files enqueued completely (worker/state/ledger.py)
ROOT_ID_FILE = ".hsfarm-root-id"  # a random id written once per output dir (never copied)
CANARY_FILE = "canary.safetensors"
FINAL_NORM_FILE = "final_norm.safetensors"
INDEX_JSONL = "index.jsonl"  # the training index (training/index.py)
TOKEN_COUNTS = "token_counts.safetensors"
SAMPLES_DIR = "samples"
REMOVED_DIR = "removed"  # samples that left the run (worker/core/setaside.py)
DONE_ELSEWHERE_DIR = "done-elsewhere"  # files the run holds on another host
GENERATED_DIR = "generated"  # a regenerating run's turns per sample (worker/regen/record.py)
TMP_MARK = dumpfile.TMP_MARK


def shard_of(sample_key: str, shards: int = 256) -> str:
    """The sub-directory a final file lives in: a stable hash bucket, 2 hex digits."""
    bucket = int(hashlib.sha256(sample_key.encode()).hexdigest()[:8], 16) % shards
    return f"{bucket:02x}"


def final_path(out_dir: Path, sample_key: str) -> Path:
    """The final file of ``sample_key``: ``samples/<shard>/<key>.safetensors``."""
    return out_dir / SAMPLES_DIR / shard_of(sample_key) / f"{sample_key}{dumpfile.DUMP_SUFFIX}"


def removed_path(out_dir: Path, key: str, content_sha256: str) -> Path:
    """Where the final file of ``key`` with this content is kept aside."""
    return (out_dir / REMOVED_DIR / shard_of(key)
            / f"{key}.{content_sha256 or 'unknown'}{dumpfile.DUMP_SUFFIX}")


def vocab_mapping_path(out_dir: Path, draft_vocab_size: int) -> Path:
    return out_dir / f"vocab_mapping-{draft_vocab_size}.pt"


def temp_path(final: Path) -> Path:
    """A temp path beside ``final``, named for this writer."""
    return final.with_name(f".{final.name}{TMP_MARK}{temp_tag()}")


def temp_tag() -> str:
    """Who writes: lets start-up cleanup tell a crashed writer's temp from a live one's."""
    return liveness.temp_tag(uuid.uuid4().hex[:8])


def temp_writer_dead(name: str) -> bool:
    """True if a temp file's name says it was written by a process of this machine now gone."""
    parts = name.rsplit(TMP_MARK, 1)
    return dumpfile.is_temp_name(name) and liveness.temp_writer_gone(parts[1])
