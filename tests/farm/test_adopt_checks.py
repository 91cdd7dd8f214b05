"""``adopt``'s checks of what it lets in: the served identity before any source is read, each
hsfarm file's own header, every file's rows over its whole length against the live server, and
each file written as it was checked.

Real processes: a private Redis, the reference server (the tiny model, or a fine-tune of it:
the same config and tokenizer, other weights), ``python -m producer adopt`` as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_dump.dumpfile import M_LAYERS, T_AUX, T_HIDDEN, T_INPUT_IDS, T_LOSS_MASK
from producer.adopt.formats import open_sample
from producer.adopt.procedure import Run
from producer.adopt.procedure import adopt as run_adopt
from producer.localfarm.farm import LocalFarm
from sglang_patch.tiny_model import ensure_tiny_model
from tests.conftest import CACHE, EXAMPLES, FarmFactory
from tests.support import adopt_sources as srcs
from tests.support.faults import running_farm
from worker.core import checksums, tensorfile, weights
from worker.core.finalfile import M_FINGERPRINT
from worker.core.settings import Settings
from worker.server.chat import ChatTokenizer
from worker.server.fingerprint import load_run

N_DATA = 20


def _data(work: Path) -> tuple[Path, list[dict[str, Any]]]:
    records = json.loads(EXAMPLES.read_text())[:N_DATA]
    path = work / "data.json"
    path.write_text(json.dumps(records))
    return path, records


def _chat(model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(model), 8192, "reject")


def adopt(farm: LocalFarm, source: Path, data: Path,
          *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m producer adopt`` into the farm's run."""
    argv = [sys.executable, "-m", "producer", "adopt", str(source), "--data", str(data),
            "--no-progress", "--seed", "1", *args]
    return subprocess.run(argv, env=farm.env(), capture_output=True, text=True, timeout=400)


def finals(out: Path) -> list[Path]:
    return list((out / "samples").rglob("*.safetensors")) if out.exists() else []


def _count(text: str, what: str) -> int:
    for line in text.splitlines():
        if line.startswith(f"{what}: "):
            return int(line.split(": ")[1].split()[0])  # "adopted: 6 samples"
    raise AssertionError(f"no '{what}:' line in:\n{text}")


def test_adopt_as_first_command_refuses_a_server_on_another_checkpoint(
        tmp_path: Path, tiny_model: Path) -> None:
    # Given a new run on checkpoint A (FARM_MODEL_PATH) whose server still serves checkpoint B
    # (same config and tokenizer, other weights), and 20 files that B wrote
    tuned = ensure_tiny_model(CACHE, seed=1)
    with running_farm(tmp_path, server_args=["--model", str(tuned)],
                      env={"FARM_MODEL_PATH": str(tiny_model)}) as farm:
        data, records = _data(tmp_path)
        src = tmp_path / "of-b"
        srcs.write_specforge(src, srcs.extract(tuned, records, _chat(tiny_model)))
        # When adopt is the run's first command
        res = adopt(farm, src, data)
        # Then it exits 2 naming both checkpoints and the fix, and nothing is written
        out = res.stdout + res.stderr
        assert res.returncode == 2, out
        tuned_id = weights.weights_identity(tuned)["id"]
        base_id = weights.weights_identity(tiny_model)["id"]
        assert f"serves weights {tuned_id}" in res.stderr, out
        assert f"FARM_MODEL_PATH={tiny_model} holds {base_id}" in res.stderr, out
        assert "Nothing was adopted." in res.stderr and "restart the server" in res.stderr, out
        assert not finals(farm.output_dir)
        assert not (farm.output_dir / "manifest.json").exists()
        # And once the server serves A, B's files are refused as another checkpoint's
        farm.procs["server"].stop()
        farm.start_server(["--model", str(tiny_model)])
        res = adopt(farm, src, data)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "another model or checkpoint" in res.stdout, res.stdout
        assert not finals(farm.output_dir)


def test_adopt_refuses_a_server_capturing_other_layers(tmp_path: Path, tiny_model: Path) -> None:
    # Given the run's model served with other --layers-to-capture than the run's (2, 4, 5)
    with running_farm(tmp_path, server_args=["--layers-to-capture", "1", "2", "3"]) as farm:
        data, records = _data(tmp_path)
        src = tmp_path / "sf"
        srcs.write_specforge(src, srcs.extract(tiny_model, records[:4], _chat(tiny_model)))
        # When adopt runs, Then it exits 2 naming both layer sets, and writes nothing
        res = adopt(farm, src, data)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "server captures layers [1, 2, 3], this run expects [2, 4, 5]" in res.stderr, (
            res.stderr)
        assert "Nothing was adopted." in res.stderr and "--layers-to-capture" in res.stderr
        assert not finals(farm.output_dir)
        assert not (farm.output_dir / "manifest.json").exists()


@pytest.fixture(scope="module")
def farm(module_farm_factory: FarmFactory) -> LocalFarm:
    return module_farm_factory("adoptchecks", chunked_prefill_size=64)


def _write_hsfarm_of_another_run(src: Path, items: list[srcs.Extracted], name: str) -> None:
    """Files another hsfarm run wrote, its layers and fingerprint id in their own headers."""
    for i, e in enumerate(items):
        tensors = {T_INPUT_IDS: tensorfile.Tensor("I64", np.asarray(e.ids, dtype=np.int64)),
                   T_LOSS_MASK: tensorfile.Tensor("I64", np.asarray(e.mask, dtype=np.int64)),
                   T_HIDDEN: tensorfile.Tensor("BF16", srcs.bits(e.hidden)),
                   T_AUX: tensorfile.Tensor("BF16", srcs.bits(e.aux))}
        sums = {k: checksums.tensor_checksum(np.ascontiguousarray(t.array).data)
                for k, t in tensors.items()}
        meta = {**checksums.checksum_metadata(sums), M_LAYERS: "[1, 2, 3]",
                M_FINGERPRINT: "0123456789abcdef"}
        tensorfile.write(src / "samples" / "00" / f"{name}{i}.safetensors", tensors, meta)


def test_hsfarm_files_naming_another_run_in_their_header_are_refused(
        farm: LocalFarm, tmp_path: Path, tiny_model: Path) -> None:
    # Given another hsfarm output dir: 6 files of this run's model and layers, and 2 that a run
    # capturing layers [1, 2, 3] wrote (their headers say so, and another fingerprint id)
    data, records = _data(tmp_path)
    chat = _chat(tiny_model)
    src = tmp_path / "hs"
    srcs.write_hsfarm(src, srcs.extract(tiny_model, records[:6], chat))
    _write_hsfarm_of_another_run(src, srcs.extract(tiny_model, records[6:8], chat,
                                                   layers=(1, 2, 3)), "other")
    # When adopt takes the dir, checking one whole file
    res = adopt(farm, src, data, "--check", "1", "--seed", "3")
    # Then the 2 are refused with the fields named, the 6 adopted (exit 1: some refused)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert _count(out, "adopted") == 6 and _count(out, "refused") == 2, out
    for i in range(2):
        line = next(x for x in out.splitlines() if x.startswith(f"  samples/00/other{i}."))
        assert "layers [1, 2, 3]" in line and "fingerprint id 0123456789abcdef" in line, line
    assert "own header" in out and "of 8" in out, out
    assert len(finals(farm.output_dir)) == 6


def test_a_foreign_minority_is_caught_file_by_file(
        farm: LocalFarm, tmp_path: Path, tiny_model: Path) -> None:
    # Given 20 SpecForge files (no header to tell), one of them written by another checkpoint
    data, records = _data(tmp_path)
    chat = _chat(tiny_model)
    other = ensure_tiny_model(CACHE, seed=1)
    items = srcs.extract(tiny_model, records[:19], chat) + srcs.extract(other, records[19:], chat)
    src = tmp_path / "sf"
    srcs.write_specforge(src, items)
    foreign = tuple(items[-1].ids)
    # When adopt checks one whole file (the foreign one is not it)
    out_dir = tmp_path / "out"
    env = {**farm.env(), "FARM_OUTPUT_DIR": str(out_dir)}
    res = subprocess.run([sys.executable, "-m", "producer", "adopt", str(src), "--data",
                          str(data), "--no-progress", "--seed", "1", "--check", "1"],
                         env=env, capture_output=True, text=True, timeout=400)
    # Then the per-file check refuses the foreign file alone and adopts the 19
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert _count(out, "adopted") == 19 and _count(out, "refused") == 1, out
    assert "are not the server's" in out, out
    assert "checked per run: served identity" in out and "detection guarantee" in out, out
    adopted = {tuple(tensorfile.read(p).tensors[T_INPUT_IDS].array.tolist())
               for p in finals(out_dir)}
    assert len(adopted) == 19 and foreign not in adopted


def _adopted_ids(out: Path) -> set[tuple[int, ...]]:
    return {tuple(tensorfile.read(p).tensors[T_INPUT_IDS].array.tolist()) for p in finals(out)}


def test_a_file_damaged_after_its_first_rows_is_refused(
        farm: LocalFarm, tmp_path: Path, tiny_model: Path) -> None:
    # Given 20 SpecForge files of this run's model, two of them damaged past their first 32
    # rows: one whose rows from 32 on another checkpoint wrote, one shifted by a row from 40 on
    data, records = _data(tmp_path)
    chat = _chat(tiny_model)
    items = srcs.extract(tiny_model, records, chat)
    other = srcs.extract(ensure_tiny_model(CACHE, seed=1), records[2:3], chat)[0]
    items[2] = srcs.tail_of(items[2], other, 32)
    items[3] = srcs.shifted_from(items[3], 40)
    damaged = {tuple(items[2].ids), tuple(items[3].ids)}
    src = tmp_path / "sf"
    srcs.write_specforge(src, items)
    # When adopt checks one whole file (record 4's with --seed 1: neither damaged one)
    out_dir = tmp_path / "out"
    env = {**farm.env(), "FARM_OUTPUT_DIR": str(out_dir)}
    res = subprocess.run([sys.executable, "-m", "producer", "adopt", str(src), "--data",
                          str(data), "--no-progress", "--seed", "1", "--check", "1"],
                         env=env, capture_output=True, text=True, timeout=400)
    # Then the per-file check refuses both, and adopts the 18 others
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert _count(out, "adopted") == 18 and _count(out, "refused") == 2, out
    assert out.count("are not the server's") == 2, out
    assert len(_adopted_ids(out_dir)) == 18 and not damaged & _adopted_ids(out_dir)


def test_a_source_file_changed_between_its_check_and_its_write_is_not_adopted(
        farm: LocalFarm, tmp_path: Path, tiny_model: Path) -> None:
    # Given 6 SpecForge files of this run's model, and for two of their records files of the
    # same ids that another checkpoint wrote
    data, records = _data(tmp_path)
    chat = _chat(tiny_model)
    items = srcs.extract(tiny_model, records[:6], chat)
    src, spare = tmp_path / "sf", tmp_path / "spare"
    paths = srcs.write_specforge(src, items)
    others = srcs.extract(ensure_tiny_model(CACHE, seed=1), records[:6], chat)
    spares = srcs.write_specforge(spare, others)  # the same names for the same records
    renamed, rewritten = paths[0], paths[1]
    assert os.path.getsize(rewritten) == os.path.getsize(spare / rewritten.name)
    assert [p.name for p in spares] == [p.name for p in paths]  # same order, same records
    changed = {tuple(open_sample(p, "specforge").input_ids.tolist())
               for p in (renamed, rewritten)}
    assert changed == {tuple(open_sample(spare / p.name, "specforge").input_ids.tolist())
                       for p in (renamed, rewritten)}

    def swap() -> None:  # once every check passed, before anything is written
        os.replace(spare / renamed.name, renamed)  # another file at its name
        st = os.stat(rewritten)  # the same file rewritten in place: size and mtime kept
        with open(rewritten, "r+b") as f:
            f.write((spare / rewritten.name).read_bytes())
        os.utime(rewritten, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(rewritten).st_mtime_ns == st.st_mtime_ns

    # When adopt runs, the two files changing between its checks and its writes
    out_dir = tmp_path / "out"
    settings = Settings.from_env({**farm.env(), "FARM_OUTPUT_DIR": str(out_dir)})
    model_path, run_chat, fp = load_run(settings)
    report = run_adopt(Run(settings, run_chat, fp, model_path), src, data, progress=False,
                       seed=1, after_check=swap)
    # Then neither is adopted, each refused as changed since its check; the 4 others are
    text = "\n".join(report.lines())
    assert report.adopted == 4 and len(report.refused) == 2, text
    assert all("since it was checked" in why for _, why in report.refused), text
    assert len(_adopted_ids(out_dir)) == 4 and not changed & _adopted_ids(out_dir), text
