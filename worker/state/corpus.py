"""The run's record of its data files, and of the samples waiting for one to be readable.

A data file is known by its content too (``FILE_INFO``, layout in keys.py): a file enqueued
from a new path with a recorded file's content is that file moved; its fid is re-pointed, and
every host reads its messages from there (``resolve`` goes through Redis, not the message's
path). A sample whose file cannot be read is *parked*, so no process waits on it and no other
file's samples behind it, until ``enqueue`` or a janitor (``resume_parked``) publishes it again.
Test: tests/farm/test_corpus.py::test_parked_samples_are_published_again_once_their_file_reads."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from worker.core.errors import MalformedMessage, RecordRemoved
from worker.core.samples import SampleRef
from worker.state import keys
from worker.state.broker import redis_errors
from worker.state.index import RunIndex, as_text, bounded

log = logging.getLogger("hsfarm.corpus")
MAX_FORMER_PATHS = 20  # former paths remembered per data file


@dataclass(frozen=True)
class FileInfo:
    """One data file of the run: where it is now, its content, where it was before."""

    fid: int
    path: str
    sha256: str = ""
    size: int = 0
    former: tuple[str, ...] = field(default_factory=tuple)

    def encode(self) -> bytes:
        return orjson.dumps({"path": self.path, "sha256": self.sha256, "size": self.size,
                             "former": list(self.former)})

    @classmethod
    def decode(cls, fid: int, raw: bytes | str) -> FileInfo:
        d = orjson.loads(raw)
        return cls(fid, str(d["path"]), str(d.get("sha256", "")), int(d.get("size", 0)),
                   tuple(str(p) for p in d.get("former", [])))


@dataclass(frozen=True)
class Identified:
    """Which fid a file enqueued from ``path`` is, and the path it was moved from (if so)."""

    fid: int
    moved_from: str | None = None


class Corpus:
    """The data-file part of one run's index (same Redis, same keys)."""

    def __init__(self, index: RunIndex) -> None:
        self.index = index
        self.r = index.r

    def k(self, name: str) -> str:
        return self.index.k(name)

    # --- identity ------------------------------------------------------------------------

    @redis_errors
    def files(self) -> dict[int, FileInfo]:
        """Every data file of the run by fid (files enqueued before contents were recorded
        have only their path)."""
        paths = {fid: path for path, fid in self.index.data_files().items()}
        raw: dict[bytes, bytes] = self.r.hgetall(self.k(keys.FILE_INFO))  # type: ignore[assignment]
        infos = {int(k): FileInfo.decode(int(k), v) for k, v in raw.items()}
        return {fid: infos.get(fid, FileInfo(fid, path)) for fid, path in paths.items()}

    @staticmethod
    def known_paths(files: dict[int, FileInfo]) -> dict[str, int]:
        """Every path a data file of ``files`` has or had -> its fid (a message may name
        any of them)."""
        out: dict[str, int] = {}
        for info in files.values():
            out.update({p: info.fid for p in info.former})
        out.update({info.path: info.fid for info in files.values()})
        return out

    @redis_errors
    def lookup(self, path: str, sha256: str) -> Identified:
        """Which recorded file the file at ``path`` with this content is, without recording
        anything: the one at this path; else one with this content (moved or renamed);
        else none (fid 0)."""
        files = self.files()
        by_path = next((i for i in files.values() if i.path == path), None)
        if by_path is not None:
            return Identified(by_path.fid)
        same = next((i for i in files.values() if sha256 and i.sha256 == sha256), None)
        if same is not None:
            return Identified(same.fid, moved_from=same.path)
        return Identified(0)

    @redis_errors
    def identify(self, path: str, sha256: str, size: int, moved_and_edited: int = 0) -> Identified:
        """``lookup``, recorded: a moved file's fid is re-pointed to ``path``, a new file gets
        a fid, and the file's content is recorded. ``moved_and_edited``: the fid this file
        is when lookup finds none (``predecessor``). Called under the run's enqueue lock."""
        found = self.lookup(path, sha256)
        files = self.files()
        if not found.fid and moved_and_edited in files:
            found = Identified(moved_and_edited, moved_from=files[moved_and_edited].path)
        if found.moved_from is not None:
            self._repoint(files[found.fid], path)
        fid = found.fid or self.index.register_file(path)
        before = files.get(fid)
        former = () if before is None else (*before.former, before.path)
        former = tuple(dict.fromkeys(p for p in former if p != path))[-MAX_FORMER_PATHS:]
        self._record(FileInfo(fid, path, sha256, size, former))
        return Identified(fid, found.moved_from)

    @redis_errors
    def predecessor(self, sample_keys: list[str]) -> int:
        """The data file a file whose first records have ``sample_keys`` was moved from,
        edited: the one that registered most of them, when its recorded path no longer
        exists here; else 0."""
        votes: dict[int, int] = {}
        for reg in self.index.registered(sample_keys):
            if reg is not None:
                votes[reg.fid] = votes.get(reg.fid, 0) + 1
        if not votes:
            return 0
        fid, n = max(votes.items(), key=lambda kv: kv[1])
        info = self.files().get(fid)
        gone = info is not None and not os.path.exists(info.path)
        return fid if gone and 2 * n > len(sample_keys) else 0

    def paths_of(self, fid: int) -> set[str]:
        """Every path data file ``fid`` has or had."""
        info = self.files().get(fid)
        return set() if info is None else {info.path, *info.former}

    def _repoint(self, info: FileInfo, path: str) -> None:
        p = self.r.pipeline()
        p.hdel(self.k(keys.FILES), info.path)
        p.hset(self.k(keys.FILES), path, info.fid)
        p.hdel(self.k(keys.UNREADABLE), str(info.fid))
        p.execute()
        log.info("data file #%d moved: %s -> %s", info.fid, info.path, path)

    def _record(self, info: FileInfo) -> None:
        self.r.hset(self.k(keys.FILE_INFO), str(info.fid), info.encode())

    # --- resolving a message ------------------------------------------------------------------

    @redis_errors
    def resolve(self, sent: SampleRef) -> SampleRef:
        """The sample a message names, as the run records it now: its data file's current
        path and the record's place and content (a corrected record of the same key is
        taken in place of the one the message was published for).

        Raises:
            MalformedMessage: the message names no data file of this run.
            RecordRemoved: the sample is no longer in the run (its record left the corpus).
        """
        files = self.files()
        sent.resolved(self.known_paths(files))  # the message's own reference must be the run's
        reg = self.index.registered([sent.key])[0]
        if reg is None:
            raise RecordRemoved(f"{sent.key}: no longer in the run (its record was removed "
                                "from its data file, or replaced by a corrected one)")
        info = files.get(reg.fid)
        if info is None:
            raise MalformedMessage(f"{sent.key}: registered in data file #{reg.fid}, which the "
                                   "run does not record")
        return reg.ref(sent.key, info.path)

    # --- parking ------------------------------------------------------------------------------

    @redis_errors
    def park(self, ref: SampleRef, reason: str, host: str) -> None:
        """``ref``'s data file cannot be read: the sample waits, without a message."""
        body = orjson.dumps({"path": ref.file, "reason": bounded(reason), "host": host,
                             "at": time.time()})
        p = self.r.pipeline()
        p.hset(self.k(keys.PARKED), ref.key, ref.fid)
        p.hset(self.k(keys.UNREADABLE), str(ref.fid), body)
        p.hdel(self.k(keys.RUNNING), ref.key)
        p.hdel(self.k(keys.RETRYING), ref.key)
        p.execute()

    @redis_errors
    def parked(self) -> dict[str, int]:
        """Parked samples: key -> fid."""
        raw: dict[bytes, bytes] = self.r.hgetall(self.k(keys.PARKED))  # type: ignore[assignment]
        return {as_text(k): int(v) for k, v in raw.items()}

    @redis_errors
    def unreadable(self) -> dict[int, dict[str, Any]]:
        """Data files a worker could not read: fid -> {path, reason, host, at}."""
        raw: dict[bytes, bytes] = self.r.hgetall(self.k(keys.UNREADABLE))  # type: ignore[assignment]
        return {int(k): orjson.loads(v) for k, v in raw.items()}

    @redis_errors
    def take_parked(self, fid: int) -> list[str]:
        """Unpark every sample of ``fid``; returns those this caller unparked (HDEL answers 1
        to one caller only, so two processes never both publish one sample)."""
        mine = [k for k, f in self.parked().items() if f == fid]
        p = self.r.pipeline()
        for key in mine:
            p.hdel(self.k(keys.PARKED), key)
        return [k for k, n in zip(mine, p.execute(), strict=True) if n]

    @redis_errors
    def repark(self, sample_keys: list[str], fid: int) -> None:
        """Park again samples ``take_parked`` gave a caller that could not publish them."""
        if sample_keys:
            self.r.hset(self.k(keys.PARKED), mapping=dict.fromkeys(sample_keys, fid))

    @redis_errors
    def clear_unreadable(self, fid: int) -> None:
        self.r.hdel(self.k(keys.UNREADABLE), str(fid))


def readable(path: str) -> str | None:
    """None when ``path`` can be opened for reading here, else why not."""
    try:
        with open(path, "rb"):
            return None
    except OSError as e:
        return os.strerror(e.errno) if e.errno else str(e)
