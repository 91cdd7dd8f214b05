"""Redis key names, in one place. Everything of one run lives under ``hsfarm:<run id>:``
(``worker.core.run``: one output dir of one model and checkpoint).

Redis is the queue and an index for ``status``; the output disk is the source of truth.
"""

from __future__ import annotations

PREFIX = "hsfarm"

# --- one run's index (hashes keyed by sample key unless said otherwise) -----------------------
# sample_key -> where its record is: "fid|offset|length|sha|index". The run's record of what
# it holds: a worker resolves every message through it (worker/state/corpus.py), a key not here is
# not in the run (its message is acknowledged as removed), and the path of fid is in FILES
SAMPLES = "samples"
FILES = "files"  # data file path -> its small integer id (fid): the current path of each file
# fid -> JSON {path, sha256 (of the whole file), size, former: [paths it had]}: a data file is
# known by its content too; enqueue of a moved file re-points its fid (worker/state/corpus.py)
FILE_INFO = "file-info"
PARKED = "parked"  # sample_key -> fid: its data file could not be read; no message until it can
UNREADABLE = "unreadable"  # fid -> JSON {path, reason, host, at}: the file a worker could not read
# sample_key -> JSON {reason, file, at}: left the run (its record was removed from the corpus
# or replaced by a corrected one); its output, if any, kept in <out>/removed/
REMOVED = "removed"
DONE = "done"  # zset sample_key -> unix time the verified file was written
BYTES = "bytes"  # sample_key -> bytes of the final file
TOKENS = "tokens"  # sample_key -> token count
FAILED = "failed"  # sample_key -> JSON {reason, attempts, at}
REJECTED = "rejected"  # sample_key (or "@fid:where" at enqueue) -> JSON {reason, at, record, sha}
RETRYING = "retrying"  # sample_key -> JSON {attempt, reason, at}: failed an attempt, will retry
STALE = "stale"  # sample_key -> JSON {reason, at}: its record changed after enqueue
RUNNING = "running"  # sample_key -> JSON {worker, attempt, since}
ATTEMPTS = "attempts"  # sample_key -> attempts spent (refunded when the environment failed)
TRIES = "tries"  # sample_key -> requests sent: numbers each rid, so none is ever reused
META = "meta"  # hash: started_at, published_at (the last publication), last_enqueue, ...
MALFORMED = "malformed"  # list (bounded) of refused task messages, JSON {reason, at}
PAUSED = "paused"  # process identity -> JSON {reason, at}: a process waiting out a condition
LEASE = "lease"  # LEASE:<sample_key> -> owner of the attempt running it (string, with TTL)
# held by the one enqueue, requeue or reconciler publication running for this run
ENQUEUE_LOCK = "enqueue-lock"
RECONCILE_LOCK = "reconcile-lock"  # held by the one reconciler pass of the run (reconciler.py)
ENQUEUED = "enqueued"  # data file path -> token of its last complete enqueue (ledger.py)
REPUBLISHED = "republished"  # sample_key -> times the reconciler published it again
# a regenerating run's generation, in all: turns, tokens, requests' seconds (summed), first_at,
# last_at, samples (whose last turn was generated) and sample_turns (theirs)
GENERATED = "generated"
# The run's hosts (worker/state/hosts.py):
#   host id -> JSON {output_dir, server, at, registered_at...};
# HELD: sample_key -> "host|content sha", the host whose output dir holds its final file;
# HELD_TWICE: sample_key -> JSON {hosts, kept, set_aside}: its file was on two hosts' dirs
HOSTS = "hosts"
HELD = "held"
HELD_TWICE = "held-twice"
# CANARY:<host, machine, dump dir, server start> -> "ok" (TTL FARM_CANARY_INTERVAL_S) or
# "mismatch", with its summary: the last canary verdict of that host's processes against that
# server; CANARY_LOCK: a lease (lease.py), one process checks at a time
CANARY = "canary"
CANARY_LOCK = "canary-lock"

# --- the workers themselves (not per run: kombu's unacked messages are global) ----------------
OWNERS = f"{PREFIX}:owners"  # hash delivery tag -> owner id (liveness.identity())
HEARTBEAT = f"{PREFIX}:heartbeat"  # HEARTBEAT:<owner id> -> "1", with a TTL: the owner lives


# hash run id -> unix time last seen: the runs that use one queue (more than one: shared)
QUEUE_RUNS = f"{PREFIX}:queue-runs"


def run_key(run_id: str, name: str) -> str:
    return f"{PREFIX}:{run_id}:{name}"


def queue_runs(queue: str) -> str:
    return f"{QUEUE_RUNS}:{queue}"


# kombu's Redis transport: where unacknowledged (reserved, running, waiting-for-ETA) messages
# live. Fixed names in kombu.transport.redis.Channel; used to tell "queued or running".
KOMBU_UNACKED = "unacked"
KOMBU_UNACKED_INDEX = "unacked_index"
