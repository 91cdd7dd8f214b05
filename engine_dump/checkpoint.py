"""Which checkpoint a model dir holds (its weights identity), and what each hook publishes of it.

Every weight shard is identified by its name, size, header, sampled ranges and the hash of all
its data (``weights_hash``, cached); the identity's id is the hash of them all. A server's hook
computes it from the dir it loaded (or the Hugging Face cache snapshot of a hub id) and writes
``served_weights`` into its marker and every dump; the worker compares it with the run's.
Publishing never raises: a serving process never dies for its identity, which then has no
shards and says why. Tests: tests/unit/test_weights.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from engine_dump import header_codec, weights_hash

log = logging.getLogger("hsfarm.hook")

# --- weights identity ------------------------------------------------------------------------
#
# The config and tokenizer (the fingerprint) are the same for a fine-tune of the same model, so
# each weight shard (``*.safetensors`` in the model dir) is identified by its name, its size, the
# sha256 of its safetensors header (tensor names, dtypes, shapes and offsets), the sha256 of a
# few byte ranges sampled at fixed places in its data (``WEIGHTS_SAMPLES`` ranges of
# ``WEIGHTS_SAMPLE_BYTES``: the start, evenly spread middles and the end), and the xxh3-128 of
# every byte of its data (``weights_hash``: read once per file and cached by its identity). A
# truncated shard changes its size and fails the header's own length check; a change of one
# byte anywhere changes the data hash. The sampled ranges cost a few small reads whatever the
# shard's size: they are computed at every start, as the quick check of a cached data hash.
#
# Schemes: ``shards-v1`` (an older hsfarm's) had no data hash, so it could not see a change
# between the sampled ranges (one embedding row); a run recorded under it is still compared
# on the fields it has (``WEIGHTS_SCHEME_FIELDS``), and told what that cannot see.

WEIGHTS_SCHEME = "shards-v2"  # bump when what is hashed changes: two schemes' ids never match
WEIGHTS_SCHEME_V1 = "shards-v1"
WEIGHTS_SCHEME_FIELDS = {
    WEIGHTS_SCHEME_V1: ("size", "header_sha256", "sampled_sha256"),
    WEIGHTS_SCHEME: ("size", "header_sha256", "sampled_sha256", "data_xxh3_128"),
}
WEIGHTS_SAMPLES = 8
WEIGHTS_SAMPLE_BYTES = 64 << 10


class WeightsUnreadable(ValueError):
    """A weight shard is not a whole safetensors file (truncated, damaged, not safetensors)."""


def shard_identity(path: Path) -> dict[str, Any]:
    """One shard's entry without its data hash: name, size, header hash, sampled-ranges hash,
    and (``data_start``) where its data begins.

    Raises:
        WeightsUnreadable: the file is not a whole safetensors file.
        OSError: it cannot be read.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsUnreadable(f"weight shard {path} is truncated: {size} bytes, no header")
        header_len = header_codec.length(head)
        if not header_codec.plausible(header_len, size):
            raise WeightsUnreadable(f"weight shard {path} is truncated or not safetensors: "
                                    f"header of {header_len} bytes in a {size}-byte file")
        header = f.read(header_len)
        data_end = 8 + header_len + _data_bytes(path, header)
        if data_end != size:
            raise WeightsUnreadable(f"weight shard {path} is truncated or damaged: its header "
                                    f"describes {data_end} bytes, the file has {size}")
        sampled = hashlib.sha256()
        for offset in sample_offsets(8 + header_len, size):
            f.seek(offset)
            sampled.update(f.read(WEIGHTS_SAMPLE_BYTES))
    return {"name": path.name, "size": size, "data_start": 8 + header_len,
            "header_sha256": hashlib.sha256(head + header).hexdigest(),
            "sampled_sha256": sampled.hexdigest()}


def _data_bytes(path: Path, header: bytes) -> int:
    try:
        entries, _ = header_codec.decode(header)
        ends = [int(t["data_offsets"][1]) for t in entries.values()]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsUnreadable(f"weight shard {path}: unreadable safetensors header ({e})") from e
    return max(ends, default=0)


def sample_offsets(start: int, size: int) -> list[int]:
    """Where the sampled ranges begin: ``WEIGHTS_SAMPLES`` evenly spaced over [start, size)."""
    if size - start <= WEIGHTS_SAMPLES * WEIGHTS_SAMPLE_BYTES:
        return [start]  # a small shard: its whole data is one range (read up to the end)
    last = size - WEIGHTS_SAMPLE_BYTES
    return [start + (last - start) * i // (WEIGHTS_SAMPLES - 1) for i in range(WEIGHTS_SAMPLES)]


def weights_identity(model_path: Path) -> dict[str, Any]:
    """The identity of the checkpoint in ``model_path``: ``{"scheme", "shards", "id"}``.

    A dir without ``*.safetensors`` shards (a synthetic model, weights in another format) has
    an empty list of shards. The first call for a checkpoint reads all of it (cached by
    ``weights_hash``), later ones its headers and sampled ranges.

    Raises:
        WeightsUnreadable, OSError, ImportError: a shard not whole, unreadable; no xxhash.
    """
    paths = sorted(p for p in model_path.glob("*.safetensors") if p.is_file())
    shards = [shard_identity(p) for p in paths]
    digests = weights_hash.data_hashes(model_path, [
        weights_hash.Shard(p, s.pop("data_start"), s["sampled_sha256"])
        for p, s in zip(paths, shards, strict=True)])
    for s in shards:
        s["data_xxh3_128"] = digests[s["name"]]
    body: dict[str, Any] = {"scheme": WEIGHTS_SCHEME, "shards": shards}
    blob = json.dumps(body, sort_keys=True).encode()
    return {**body, "id": hashlib.sha256(blob).hexdigest()[:16]}


def served_weights(identity: dict[str, Any], model_path: str) -> str:
    """What a server says about the weights it serves, in every dump's metadata (``M_WEIGHTS``):
    the identity's scheme, id and shard count, and the model path it loaded them from."""
    return json.dumps({"scheme": identity.get("scheme"), "id": identity.get("id"),
                       "shards": len(identity.get("shards") or []),
                       "model_path": model_path}, sort_keys=True)


def model_config_sha256(model_path: str) -> str:
    """sha256 of the model dir's ``config.json``; empty when there is none (a hub id)."""
    try:
        return hashlib.sha256((Path(model_path) / "config.json").read_bytes()).hexdigest()
    except OSError:
        return ""


def loaded_weights(model_path: str, revision: str | None = None,
                   download_dir: str | None = None) -> dict[str, Any]:
    """The weights identity of ``model_path`` (a dir, or a hub id already in the cache); on any
    failure the identity of no shards with ``error`` saying why (the canary still guards)."""
    path = model_path
    try:
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, revision=revision, cache_dir=download_dir,
                                     local_files_only=True)
        identity = weights_identity(Path(path))
    except Exception as e:  # a serving process never dies for its identity
        log.warning("hsfarm: the weights identity of %s cannot be computed: %s", path, e)
        empty = weights_identity(Path("/nonexistent"))
        return {**empty, "error": f"{type(e).__name__}: {e}"}
    log.info("hsfarm: weights identity %s (%d shards in %s)", identity["id"],
             len(identity["shards"]), path)
    return identity
