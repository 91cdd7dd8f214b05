"""The weights identity: which checkpoint a run's hidden states came from, cheap to compute.

Hashing 600 GB of weights would take longer than many runs, and the config and tokenizer
(the fingerprint) are the same for a fine-tune of the same model. So each weight shard
(``*.safetensors`` in the model dir) is identified by its name, its size, the sha256 of its
safetensors header (tensor names, dtypes, shapes and offsets) and the sha256 of a few byte
ranges sampled at fixed places in its data (``SAMPLES`` ranges of ``SAMPLE_BYTES``: the
start, evenly spread middles and the end). A retrained or swapped checkpoint changes the
sampled bytes of every shard; a truncated shard changes its size and fails the header's own
length check. Reading one shard costs a header and ``SAMPLES`` small reads, whatever its size.

What it cannot see: a change confined to bytes between the samples (a single flipped bit in
one tensor). The canary (``canary.py``) compares what the server computes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path
from typing import Any

from worker.errors import ConfigError

log = logging.getLogger("hsfarm.weights")

SCHEME = "shards-v1"  # bump when what is hashed changes: identities of two schemes never match
SAMPLES = 8
SAMPLE_BYTES = 64 << 10
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
M_WEIGHTS_ID = "weights_id"  # final-file metadata key: the identity it was written under


def shard_identity(path: Path) -> dict[str, Any]:
    """One shard's entry: name, size, header hash, sampled-ranges hash.

    Raises:
        ConfigError: the file is not a whole safetensors file (truncated, not safetensors).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"weight shard {path} is truncated: {size} bytes, no header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise ConfigError(f"weight shard {path} is truncated or not safetensors: header "
                              f"of {header_len} bytes in a {size}-byte file")
        header = f.read(header_len)
        data_end = 8 + header_len + _data_bytes(path, header)
        if data_end != size:
            raise ConfigError(f"weight shard {path} is truncated or damaged: its header "
                              f"describes {data_end} bytes, the file has {size}")
        sampled = hashlib.sha256()
        for offset in sample_offsets(8 + header_len, size):
            f.seek(offset)
            sampled.update(f.read(SAMPLE_BYTES))
    return {"name": path.name, "size": size,
            "header_sha256": hashlib.sha256(head + header).hexdigest(),
            "sampled_sha256": sampled.hexdigest()}


def _data_bytes(path: Path, header: bytes) -> int:
    try:
        entries = json.loads(header)
        ends = [int(t["data_offsets"][1]) for name, t in entries.items()
                if name != "__metadata__"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"weight shard {path}: unreadable safetensors header ({e})") from e
    return max(ends, default=0)


def sample_offsets(start: int, size: int) -> list[int]:
    """Where the sampled ranges begin: ``SAMPLES`` evenly spaced over [start, size)."""
    span = size - start
    if span <= SAMPLES * SAMPLE_BYTES:
        return [start]  # a small shard: its whole data is one range (read up to the end)
    last = size - SAMPLE_BYTES
    return [start + (last - start) * i // (SAMPLES - 1) for i in range(SAMPLES)]


def weights_identity(model_path: Path) -> dict[str, Any]:
    """The identity of the checkpoint in ``model_path``: every ``*.safetensors`` shard.

    A model dir without safetensors shards (a synthetic model, weights in another format)
    has an empty list of shards: nothing to compare but the canary, which the log says.

    Raises:
        ConfigError: a shard is not whole.
    """
    shards = sorted(p for p in model_path.glob("*.safetensors") if p.is_file())
    if not shards:
        log.warning("no *.safetensors weight files in %s: the weights cannot be identified "
                    "(only the canary guards them)", model_path)
    entries = [shard_identity(p) for p in shards]
    body = {"scheme": SCHEME, "shards": entries}
    return {**body, "id": _digest(body)}


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def incomparable(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why the two identities cannot be compared (then only the canary can tell), or None.

    A host whose model dir holds only the config and tokenizer (the weights live where the
    server runs), a run recorded on such a host, or an identity of another scheme (another
    hsfarm version) says nothing about the weights: refusing the run for it would stop a
    healthy farm.
    """
    if recorded.get("scheme") != current.get("scheme"):
        return (f"the run recorded identity scheme {recorded.get('scheme')!r}, this hsfarm "
                f"computes {current.get('scheme')!r}")
    if not current.get("shards"):
        return "this host's model dir has no *.safetensors weight files"
    if not recorded.get("shards"):
        return "the run was recorded from a model dir without *.safetensors weight files"
    return None


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two identities, shard by shard, in words (empty: the same)."""
    if recorded.get("scheme") != current.get("scheme"):
        return [f"identity scheme {recorded.get('scheme')!r} != {current.get('scheme')!r}"]
    mine = {s["name"]: s for s in recorded.get("shards", [])}
    now = {s["name"]: s for s in current.get("shards", [])}
    out = [f"{n}: missing now" for n in sorted(set(mine) - set(now))]
    out += [f"{n}: not in the recorded checkpoint" for n in sorted(set(now) - set(mine))]
    for name in sorted(set(mine) & set(now)):
        a, b = mine[name], now[name]
        what = [k for k in ("size", "header_sha256", "sampled_sha256") if a.get(k) != b.get(k)]
        if "size" in what:
            out.append(f"{name}: size {a.get('size')} != {b.get('size')}")
        elif what:
            out.append(f"{name}: {' and '.join(k.replace('_sha256', '') for k in what)} "
                       "bytes differ")
    return out


def mismatch(recorded: dict[str, Any], current: dict[str, Any], model_path: Path) -> str | None:
    """Why ``current`` is not the ``recorded`` checkpoint, with the two ways on; None if it is."""
    diff = differences(recorded, current)
    if not diff:
        return None
    shown = "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
    return (f"the weights in {model_path} are not the checkpoint this run's hidden states came "
            f"from (weights identity {current.get('id')} != recorded {recorded.get('id')}): "
            f"{shown}. Restore the original checkpoint (and serve it), or start a new "
            "FARM_OUTPUT_DIR for the new one.")
