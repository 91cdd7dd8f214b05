"""A ``torch.utils.data.Dataset`` over an output directory, read in place.

Each item is one sample in a trainer's view (``training.views``); its tensors are the page
cache's pages of a memory-mapped file, because allocating and filling a copy costs 4x the read
at 86-470 MB samples (docs/benchmarks.md). The whole file is asked for at getitem (read ahead);
``lazy=True`` reads only the pages a loop touches. Headers are checked on access, checksums
with ``verify=True``; fp8 states come as bf16; the order is ``index.jsonl``'s when it exists.
Test: tests/farm/test_training.py::test_loader_views_hold_our_tensors_without_a_copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from engine_dump.dumpfile import DUMP_SUFFIX, T_INPUT_IDS
from training import fp8, index, roots, views
from training.manifest import load_run_info
from training.sample_file import SampleFile
from worker.core import checksums
from worker.core.errors import ConfigError, Corrupt
from worker.core.finalfile import conversation_of


class HiddenStates(Dataset[dict[str, Any]]):
    """Samples of one output dir, in one trainer's view.

    Raises:
        ConfigError: not an output dir, an unknown view, or (speculators) no final norm.
    """

    def __init__(self, out_dir: Path, view: str = "hsfarm", verify: bool = False,
                 lazy: bool = False) -> None:
        if view not in views.VIEWS:
            raise ConfigError(f"unknown view {view!r}: one of {', '.join(views.VIEWS)}")
        self.info = load_run_info(Path(out_dir))
        self.view = views.VIEW_FUNCS[view]
        self.verify = verify
        self.lazy = lazy  # pages read when touched; else the whole file read ahead
        self.norm_w = self.info.final_norm().as_float32() if view == "speculators" else None
        rows = index.read_rows(self.info.out_dir)
        if rows:
            self.keys = sorted(rows)
            self.paths = [self.info.out_dir / rows[k]["path"] for k in self.keys]
            self.lengths = [int(rows[k]["tokens"]) for k in self.keys]
        else:
            self.paths = list(roots.sample_files(self.info.out_dir))
            self.keys = [p.name[: -len(DUMP_SUFFIX)] for p in self.paths]
            self.lengths = [SampleFile.open(p).entries[T_INPUT_IDS].shape[0]
                            for p in self.paths]

    def __len__(self) -> int:
        return len(self.paths)

    def conversation(self, i: int) -> dict[str, Any] | None:
        """The conversation sample ``i``'s states are of, when its run regenerated it
        (docs/regeneration.md): ``messages`` (the regenerated conversation) and
        ``generation`` (the settings and each turn's output ids, finish and seed); None for a
        sample extracted from the conversation given."""
        return conversation_of(SampleFile.open(self.paths[i]).metadata)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """One sample. Raises Corrupt (wrong run, shapes, or with verify a checksum)."""
        sf = SampleFile.open(self.paths[i])
        self.info.check_sample(sf, self.keys[i])
        arrays: dict[str, np.ndarray] = sf.map_all(prefetch=not self.lazy)
        if self.verify:
            bad = checksums.mismatches(checksums.recorded(sf.metadata), arrays)
            if bad:
                raise Corrupt(f"{sf.path}: checksum of {', '.join(bad)}")
        if self.info.fp8:  # checksums cover the stored bytes; trainers get bf16
            arrays = fp8.to_bf16(arrays)
        return self.view(self.keys[i], arrays, self.norm_w)
