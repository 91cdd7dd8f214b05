"""Redis key names, in one place. Everything of one run lives under ``hsfarm:<fingerprint id>:``.

Redis is the queue and an index for ``status``; the output disk is the source of truth.
"""

from __future__ import annotations

PREFIX = "hsfarm"

DONE = "done"  # zset sample_key -> unix time the verified file was written
BYTES = "bytes"  # hash sample_key -> bytes of the final file
TOKENS = "tokens"  # hash sample_key -> token count
FAILED = "failed"  # hash sample_key -> JSON {reason, attempts, at}
REJECTED = "rejected"  # hash sample_key -> JSON {reason, at, record}
RUNNING = "running"  # hash sample_key -> JSON {worker, attempt, since}
ATTEMPTS = "attempts"  # hash sample_key -> number of attempts started
META = "meta"  # hash: total, data_file (the last enqueued), ...
DATA_FILES = "data_files"  # set of every data file enqueued for this run (what audit reads)
PAUSED = "paused"  # hash worker hostname -> reason (low space)


def run_key(fingerprint_id: str, name: str) -> str:
    return f"{PREFIX}:{fingerprint_id}:{name}"


# kombu's Redis transport: where unacknowledged (reserved, running, waiting-for-ETA) messages
# live. Fixed names in kombu.transport.redis.Channel; used to tell "queued or running".
KOMBU_UNACKED = "unacked"
KOMBU_UNACKED_INDEX = "unacked_index"
