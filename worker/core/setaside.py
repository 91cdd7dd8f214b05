"""Output files of samples that left the run, kept aside: ``<out>/removed/``.

When ``enqueue`` sees that a record was removed from its data file, or replaced by a
corrected version, the sample's final file leaves ``<out>/samples/`` (what ``index``,
``export`` and trainers read) for ``<out>/removed/<shard>/<key>.<content hash>.safetensors``:
nothing of it reaches a training set, and nothing is deleted unless asked
(``enqueue --delete-removed``). The content hash in the name keeps apart successive versions
of one key. A rename on one filesystem, then both directories fsynced.
"""

from __future__ import annotations

from pathlib import Path

from engine_dump.dumpfile import DUMP_SUFFIX
from worker.core import durable, outdir, tensorfile
from worker.core.errors import Corrupt
from worker.core.finalfile import M_CONTENT


def set_aside(out_dir: Path, key: str, delete: bool = False) -> Path | None:
    """Move ``key``'s final file into ``<out>/removed/`` (or delete it, ``delete``).
    Returns where it went (``out_dir`` itself when deleted), or None when there was none.

    Raises:
        OSError: the move failed (the file stays where it was).
    """
    final = outdir.final_path(out_dir, key)
    if not final.exists():
        return None
    if delete:
        durable.remove(final)
        return out_dir
    try:
        content = tensorfile.header_metadata(final).get(M_CONTENT, "")
    except (Corrupt, OSError):
        content = ""
    dest = outdir.removed_path(out_dir, key, str(content))
    dest.parent.mkdir(parents=True, exist_ok=True)
    durable.move(final, dest)
    return dest


def kept_aside(out_dir: Path) -> list[Path]:
    """Every file kept in ``<out>/removed/``."""
    root = out_dir / outdir.REMOVED_DIR
    return sorted(p for p in root.rglob(f"*{DUMP_SUFFIX}")) if root.is_dir() else []


def removed_by_key(out_dir: Path) -> dict[str, list[Path]]:
    """The files kept aside, by sample key (``<key>.<content hash>.safetensors``)."""
    out: dict[str, list[Path]] = {}
    for p in kept_aside(out_dir):
        out.setdefault(p.name[: -len(DUMP_SUFFIX)].rsplit(".", 1)[0], []).append(p)
    return out
