"""The run id, its queue and task ids (worker/core/run.py): what tells two runs apart."""

from __future__ import annotations

import json
from pathlib import Path

from engine_dump.rids import NO_RUN, RUN_ID_RE
from worker.core import outdir, run
from worker.core.settings import Settings
from worker.state.queue_scan import task_id

MANIFEST = {"fingerprint_id": "a" * 16, "weights": {"id": "b" * 16},
            "run_nonce": "c" * 32, "created_at": 1.5}


def test_the_run_id_tells_apart_checkpoints_output_dirs_and_fingerprints() -> None:
    ids = {run.run_id(MANIFEST),
           run.run_id({**MANIFEST, "weights": {"id": "d" * 16}}),  # another checkpoint
           run.run_id({**MANIFEST, "run_nonce": "e" * 32}),  # another output dir
           run.run_id({**MANIFEST, "fingerprint_id": "f" * 16})}
    assert len(ids) == 4 and all(RUN_ID_RE.match(i) for i in ids)
    assert run.run_id(dict(MANIFEST)) == run.run_id(MANIFEST)  # stable
    # a manifest written before the nonce existed: its creation time tells it apart
    old = {k: v for k, v in MANIFEST.items() if k != "run_nonce"}
    assert run.run_id(old) != run.run_id({**old, "created_at": 2.5})


def test_the_run_id_comes_from_the_output_dir(tmp_path: Path) -> None:
    assert run.read_run_id(tmp_path) is None and run.run_id_of(tmp_path) == NO_RUN
    (tmp_path / outdir.MANIFEST).write_text(json.dumps(MANIFEST))
    assert run.read_run_id(tmp_path) == run.run_id(MANIFEST)


def test_each_run_has_its_own_queue_unless_one_is_named() -> None:
    a, b = run.run_id(MANIFEST), run.run_id({**MANIFEST, "run_nonce": "x"})
    unset = Settings()
    assert run.queue_for(unset, a) == f"hsfarm.{a}" != run.queue_for(unset, b)
    named = Settings(queue="mine")
    assert run.queue_for(named, a) == run.queue_for(named, b) == "mine"


def test_a_task_id_names_its_run() -> None:
    rid = run.run_id(MANIFEST)
    assert run.run_of_task(task_id(rid, 3, "ex-0001")) == rid
    assert run.run_of_task(task_id(rid, 3, "0123456789abcdef-x")) == rid
    for other in ("evil-key", "hsd-", f"hsd-{rid}", f"hsd-{rid[:15]}-1:k", f"hsd-{rid.upper()}-1:k",
                  None, 7):
        assert run.run_of_task(other) is None
