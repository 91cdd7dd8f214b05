"""Every data byte of a checkpoint's weight shards, hashed once per file and cached by its identity.

xxh3-128 over the mapped file, shards in parallel threads (xxhash releases the GIL); the digest
is cached under the file's (dev, inode, size, mtime_ns, ctime_ns) and its sampled-ranges hash,
recomputed each time as the entry's quick check. Beside the checkpoint when its dir is
writable (the hook and the workers of a host share it), else ``$XDG_CACHE_HOME/hsfarm/weights``.
Measured: bench/weights_hash.py, docs/canary.md. Test: tests/unit/test_weights.py.
"""

# ctime is in the key because a user cannot set it back: a shard rewritten in place with its
# mtime restored misses the cache. An exclusive lock makes processes starting at once hash each
# shard once. A cache that cannot be read or written costs a hash, never an error. xxh3-128
# finds changes, not tampering: whoever can write the checkpoint can write its cache.

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("hsfarm.weights")

ALGORITHM = "xxh3-128"
CACHE_NAME = ".hsfarm-weights-cache"  # not *.json: no loader globbing a model dir reads it
CACHE_FORMAT = 1
WINDOW_BYTES = 64 << 20  # per update: the GIL is released for each, the mapping read ahead
MAX_THREADS = 16
ENTRIES_PER_SHARD = 4  # identities kept per shard name (the dir seen from several mounts)
_FIX = "install it (pip install xxhash; a base dependency of hsfarm)"


@dataclass(frozen=True)
class Shard:
    """One shard to hash: where its data starts, and its sampled-ranges hash."""

    path: Path
    data_start: int
    sampled_sha256: str


def file_key(st: os.stat_result) -> str:
    """The identity of a file's current bytes as the file system tells it, without reading."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def data_hash(path: Path, start: int) -> str:
    """xxh3-128 of the bytes of ``path`` from ``start`` to its end, read through a mapping.

    Raises:
        OSError: it cannot be read.
        ImportError: xxhash is not installed.
    """
    try:
        import xxhash
    except ImportError as e:
        raise ImportError(f"the weights identity needs xxhash, not installed here: {_FIX}") from e
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= start:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mm)
            try:
                for at in range(start, size, WINDOW_BYTES):
                    h.update(view[at: at + WINDOW_BYTES])
            finally:
                view.release()
    return h.hexdigest()


def data_hashes(model_path: Path, shards: list[Shard]) -> dict[str, str]:
    """``{shard name: xxh3-128 of its data}``, from the cache where the file is unchanged.

    Raises:
        OSError: a shard cannot be read.
        ImportError: xxhash is not installed (and a shard is not in the cache).
    """
    keys = {s.path.name: file_key(s.path.stat()) for s in shards}
    where = cache_path(model_path)
    found = _hits(_read(where), shards, keys)
    if len(found) == len(shards):
        return found
    with _locked(where):  # a process that waited here finds the other's digests
        entries = _read(where)
        found = _hits(entries, shards, keys)
        missing = [s for s in shards if s.path.name not in found]
        if missing:
            found.update(_hash_all(missing))
            for s in missing:
                entries.pop(keys[s.path.name], None)  # the newest last
                entries[keys[s.path.name]] = {"name": s.path.name, ALGORITHM: found[s.path.name],
                                              "sampled_sha256": s.sampled_sha256}
            _write(where, entries, {s.path.name for s in shards})
    return found


def _hits(entries: dict[str, dict[str, str]], shards: list[Shard],
          keys: dict[str, str]) -> dict[str, str]:
    out = {}
    for s in shards:
        e = entries.get(keys[s.path.name])
        if e and e.get("name") == s.path.name and e.get("sampled_sha256") == s.sampled_sha256 \
                and isinstance(e.get(ALGORITHM), str):
            out[s.path.name] = e[ALGORITHM]
    return out


def _hash_all(shards: list[Shard]) -> dict[str, str]:
    total = sum(s.path.stat().st_size - s.data_start for s in shards)
    threads = max(1, min(len(shards), os.cpu_count() or 1, MAX_THREADS))
    began = time.monotonic()
    with ThreadPoolExecutor(threads, thread_name_prefix="hsfarm-weights") as pool:
        digests = list(pool.map(lambda s: data_hash(s.path, s.data_start), shards))
    took_s = time.monotonic() - began
    if total > 1 << 30:
        log.info("hsfarm: hashed %d weight shards (%.1f GB) in %.0fs on %d threads (%.2f GB/s); "
                 "cached for the next start", len(shards), total / 1e9, took_s, threads,
                 total / 1e9 / max(took_s, 1e-9))
    return {s.path.name: d for s, d in zip(shards, digests, strict=True)}


# --- the cache -------------------------------------------------------------------------------

def cache_path(model_path: Path) -> Path:
    """Beside the checkpoint where its dir is writable, else in the user's cache dir."""
    if os.access(model_path, os.W_OK):
        return model_path / CACHE_NAME
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hsfarm" / "weights"
    name = hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:16]
    return base / f"{name}{CACHE_NAME}"


def _read(path: Path) -> dict[str, dict[str, str]]:
    try:
        body = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(body, dict) or body.get("format") != CACHE_FORMAT:
        return {}
    entries = body.get("entries")
    return {k: v for k, v in entries.items() if isinstance(v, dict)} \
        if isinstance(entries, dict) else {}


def _write(path: Path, entries: dict[str, dict[str, str]], names: set[str]) -> None:
    """Keep the newest few entries of each current shard name; a failed write is only logged."""
    kept: dict[str, dict[str, str]] = {}
    for name in names:
        mine = [(k, e) for k, e in entries.items() if e.get("name") == name]
        kept.update(mine[-ENTRIES_PER_SHARD:])
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"format": CACHE_FORMAT, "entries": kept}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("hsfarm: the weights hash cache %s cannot be written (%s): the next start "
                    "hashes the checkpoint again", path, e)
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """An exclusive lock beside the cache; without one (nowhere to write) no lock."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{cache}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
