"""speculators' side files: the Arrow dataset of ids and masks, and ``token_freq.pt``.

Its ``ArrowDataset`` reads ``datasets.load_from_disk(DEST)`` (``input_ids``, ``loss_mask``,
``seq_len``) and matches row ``i`` with ``DEST/hidden_states/hs_{i}.safetensors``. Written
with pyarrow alone in ``Dataset.save_to_disk``'s layout, rebuilt from the exported files, so
it covers samples whose sources were deleted. ``token_freq.pt`` is ``{token id: count}`` over
loss-masked tokens, as ``save_token_frequency_distribution`` writes it.
Test: tests/trainers/test_speculators.py::test_its_dataset_and_collator_give_our_tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from training import vocab
from training.export.formats import Speculators
from training.export.ledger import Ledger
from worker.core import durable, outdir
from worker.core.errors import Corrupt

ARROW = "data-00000-of-00001.arrow"
TOKEN_FREQ = "token_freq.pt"
_FEATURES = {
    "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "seq_len": {"dtype": "int64", "_type": "Value"},
}
_STATE: dict[str, object] = {
    "_data_files": [{"filename": ARROW}], "_fingerprint": "", "_format_columns": None,
    "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False, "_split": None}


def write_dataset(dest: Path, ledger: Ledger) -> None:
    """Rows 0..N-1 from ``hs_0..hs_{N-1}``; then ``token_freq.pt``. Raises Corrupt on a gap."""
    import pyarrow as pa

    by_number = {e["number"]: e for e in ledger.entries.values()}
    if sorted(by_number) != list(range(len(by_number))):
        raise Corrupt(f"{dest}: exported files are not numbered 0..{len(by_number) - 1}")
    ids_col, mask_col, counts = [], [], np.zeros(0, np.int64)
    for i in range(len(by_number)):
        ids, mask = Speculators.ids_and_mask(dest / by_number[i]["path"])
        ids_col.append(ids)
        mask_col.append(mask)
        counts = vocab.add_counts(counts, vocab.count_masked(ids, mask))
    table = pa.table({"input_ids": pa.array(ids_col, pa.list_(pa.int64())),
                      "loss_mask": pa.array(mask_col, pa.list_(pa.int64())),
                      "seq_len": pa.array([len(x) for x in ids_col], pa.int64())})
    info = {"info": {"features": _FEATURES}}
    table = table.replace_schema_metadata({"huggingface": json.dumps(info)})
    fingerprint = ledger.path.stat().st_size  # changes whenever rows are added
    _write_arrow(dest / ARROW, table)
    _write_json(dest / "dataset_info.json", {"citation": "", "description": "",
                                             "features": _FEATURES, "homepage": "",
                                             "license": ""})
    _write_json(dest / "state.json", {**_STATE, "_fingerprint": f"hsfarm{fingerprint:016x}"})
    _write_token_freq(dest / TOKEN_FREQ, vocab.token_freq(counts))


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temp file to write ``path``'s new content into: committed over ``path`` when the
    block ends, removed when it raises (a full DEST keeps no temp file)."""
    tmp = outdir.temp_path(path)
    try:
        yield tmp
        durable.commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_arrow(path: Path, table: object) -> None:
    import pyarrow as pa

    with _replacing(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as w:  # type: ignore[attr-defined]
        w.write_table(table)


def _write_json(path: Path, body: dict[str, object]) -> None:
    with _replacing(path) as tmp:
        tmp.write_text(json.dumps(body, indent=2, sort_keys=True))


def _write_token_freq(path: Path, freq: dict[int, int]) -> None:
    import torch

    # a file object: torch.save's failed write then carries the OSError (ENOSPC) as context
    with _replacing(path) as tmp, open(tmp, "wb") as f:
        torch.save(freq, f)
