"""The export's ledger: ``DEST/hsfarm-export.jsonl``, one line per verified export.

A line is appended (and fsynced) only after its file was renamed into place and verified, and
before its source may be deleted: so a key in the ledger is done, and a source file is never
deleted without its line. The last line of a key wins (a re-export after its source changed,
a numbered file moved to close a gap); ``{"key": k, "removed": true}`` drops a key whose file
is gone with its source. A line cut short by a crash is dropped on open.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

NAME = "hsfarm-export.jsonl"


class Ledger:
    """Append-only record of verified exports into one destination."""

    def __init__(self, dest: Path) -> None:
        self.path = dest / NAME
        self.entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        good = 0
        if self.path.exists():
            data = self.path.read_bytes()
            for line in data.splitlines(keepends=True):
                try:
                    entry = json.loads(line) if line.endswith(b"\n") else None
                except ValueError:
                    entry = None
                if entry is None:
                    break  # a torn last line: everything after it is dropped
                self._apply(entry)
                good += len(line)
            if good != len(data):
                os.truncate(self.path, good)

    def _apply(self, entry: dict[str, Any]) -> None:
        if entry.get("removed"):
            self.entries.pop(entry["key"], None)
        else:
            self.entries[entry["key"]] = entry

    def add(self, entry: dict[str, Any]) -> None:
        """Append one entry durably."""
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        with self._lock:
            with open(self.path, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self._apply(entry)

    def remove(self, key: str) -> None:
        """Record durably that ``key`` is no longer exported."""
        self.add({"key": key, "removed": True})

    def numbers(self) -> dict[int, list[str]]:
        """Numbered layouts: number -> the keys whose entry claims it (more than one: a DEST
        written by two exports at once, before the lock)."""
        out: dict[int, list[str]] = {}
        for key, e in self.entries.items():
            out.setdefault(int(e["number"]), []).append(key)
        return out
