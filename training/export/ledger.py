"""The export's ledger: ``DEST/hsfarm-export.jsonl``, one line per verified export.

A line is appended (and fsynced) only after its file was renamed into place and verified, and
before its source may be deleted: so a key in the ledger is done, and a source file is never
deleted without its line. A line cut short by a crash is dropped on open.
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
                self.entries[entry["key"]] = entry
                good += len(line)
            if good != len(data):
                os.truncate(self.path, good)

    def add(self, entry: dict[str, Any]) -> None:
        """Append one entry durably."""
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        with self._lock:
            with open(self.path, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self.entries[entry["key"]] = entry
