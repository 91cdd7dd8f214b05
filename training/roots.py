"""One run's output spread over several roots: each host's output dir, or copies of them
gathered in one place. ``index`` and ``export`` read them as one training set.

Every root must hold the same run (its manifest names the same run id). A sample whose final
file is in two roots (a host lost between writing it and the run learning so, then the sample
redone elsewhere; or two copies gathered) is taken once: from the first root given that holds
it, and the choice is reported.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine_dump.dumpfile import DUMP_SUFFIX, is_temp_name
from worker.core.errors import ConfigError
from worker.core.run import read_run_id


@dataclass
class Gathered:
    """Each sample's file (key -> path, sorted by key), and the copies left out."""

    files: dict[str, Path] = field(default_factory=dict)
    # (key, the file kept, the file left out)
    doubles: list[tuple[str, Path, Path]] = field(default_factory=list)

    def lines(self, show: int = 20) -> list[str]:
        if not self.doubles:
            return []
        out = [f"in two roots, kept once: {len(self.doubles)} samples (the first root given "
               "that holds each)"]
        return out + [f"  {key}: kept {kept}, left out {other}"
                      for key, kept, other in self.doubles[:show]]


def check_same_run(roots: Sequence[Path]) -> None:
    """Raises ConfigError unless every root holds the first root's run."""
    first = read_run_id(roots[0])
    for root in roots[1:]:
        run = read_run_id(root)
        if run is None:
            raise ConfigError(f"{root} is not an hsfarm output dir (no readable manifest)")
        if run != first:
            raise ConfigError(f"{root} holds run {run}, not run {first} of {roots[0]}: roots "
                              "of one training set must be one run's")


def sample_files(out_dir: Path) -> Iterator[Path]:
    """Every final file under ``<out>/samples`` (never temp files), sorted."""
    if not (out_dir / "samples").is_dir():
        return
    for shard in sorted((out_dir / "samples").iterdir()):
        if shard.is_dir():
            yield from sorted(p for p in shard.glob(f"*{DUMP_SUFFIX}")
                              if not is_temp_name(p.name))


def gather(roots: Sequence[Path]) -> Gathered:
    """Every final file of the roots, each sample once (the first root's copy)."""
    got = Gathered()
    for root in roots:
        for path in sample_files(root):
            key = path.name[: -len(DUMP_SUFFIX)]
            kept = got.files.get(key)
            if kept is None:
                got.files[key] = path
            else:
                got.doubles.append((key, kept, path))
    got.files = dict(sorted(got.files.items()))
    return got
