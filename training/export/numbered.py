"""Numbered layouts (speculators' ``hs_{i}``): rows ``0..N-1``, each number held by one key.

A number is given to a key once, at its first commit; a re-export of that key (its source
changed, its file went missing or was damaged) writes the same number again. When a file is
gone together with its source, its key leaves the ledger and the highest-numbered file moves
into the gap: a hard link under the new name, the ledger line, then the old name removed, so
a crash at any point leaves the key's bytes under the name its last ledger line gives.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine_dump.dumpfile import is_temp_name
from training.export.formats import Format
from training.export.ledger import Ledger
from worker.core.diskio import fsync_dir


def close_gaps(ledger: Ledger, fmt: Format, root: Path) -> int:
    """Move the highest-numbered files into the gaps; remove files no entry names. Returns
    how many moved."""
    by_number = {int(e["number"]): e for e in ledger.entries.values()}
    n = len(by_number)
    holes = sorted(set(range(n)) - set(by_number))
    highest = sorted((k for k in by_number if k >= n), reverse=True)
    for hole, number in zip(holes, highest, strict=True):
        entry = by_number[number]
        old, rel = root / entry["path"], fmt.rel_path(entry["key"], hole)
        (root / rel).unlink(missing_ok=True)  # a file no entry names
        os.link(old, root / rel)
        fsync_dir((root / rel).parent)
        ledger.add({**entry, "number": hole, "path": rel})
        old.unlink()
        fsync_dir(old.parent)
    _remove_unnamed(ledger, fmt, root)
    return len(holes)


def _remove_unnamed(ledger: Ledger, fmt: Format, root: Path) -> None:
    """Numbered files no ledger entry names: a commit cut off before its ledger line (its
    source is still there, so it is exported again) or the old name of a moved file."""
    named = {str(root / e["path"]) for e in ledger.entries.values()}
    folder = (root / fmt.rel_path("", 0)).parent
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if not is_temp_name(p.name) and str(p) not in named:
            p.unlink()
    fsync_dir(folder)
