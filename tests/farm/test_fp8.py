"""fp8 storage through real processes: one run end to end through real workers, read back by
the training side; an fp8 export's disk budget, and a full destination named whichever writer
hits it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_HIDDEN_SCALE, T_INPUT_IDS, TMP_MARK
from tests.conftest import wait_finished
from tests.support.faults import enqueue, running_farm
from tests.support.fp8 import rel_err
from worker.core import outdir, tensorfile
from worker.core.errors import ConfigError


def test_an_fp8_run_end_to_end_read_by_the_training_side(tmp_path: Path, tiny_model: Path) -> None:
    from sglang_patch.reference_model import ReferenceModel
    from training import index
    from training.export.formats import FORMATS
    from training.export.runner import export
    from training.loader import HiddenStates

    env = {"FARM_STORE_DTYPE": "fp8_e4m3"}
    with running_farm(tmp_path, server_args=["--dump-dtype", "fp8_e4m3"], env=env) as farm:
        # Given an fp8 run of 4 samples through a real worker (the canary recorded on the way)
        farm.start_worker("w1", concurrency=2)
        keys = enqueue(farm, tmp_path, 4)
        wait_finished(farm, 4)
        out = farm.output_dir
        assert json.loads((out / "manifest.json").read_text())["fingerprint"]["dtype"] == "fp8_e4m3"
        files = [outdir.final_path(out, k) for k in keys]
        assert all(tensorfile.read_header(p).tensors[T_HIDDEN].dtype == "F8_E4M3" for p in files)
        # Then audit finds them whole, and a scale flipped on disk corrupt
        assert farm.cli("audit").returncode == 0
        head = tensorfile.read_header(files[0])
        with open(files[0], "r+b") as f:
            f.seek(head.data_start + head.tensors[T_HIDDEN_SCALE].begin + 3)
            f.write(b"\x7f")
        res = farm.cli("audit")
        assert res.returncode == 1 and f"corrupt {keys[0]}: " in res.stdout, res.stdout
        assert "checksum of hidden_state_scale" in res.stdout
        files[0].unlink()
        keys, files = keys[1:], files[1:]
    # And the loader hands out bf16 within e4m3's error of the model's bf16 states
    model = ReferenceModel(tiny_model)
    ds = HiddenStates(out, verify=True)
    assert sorted(ds.keys) == sorted(keys)
    for item in ds:
        assert item[T_HIDDEN].dtype == torch.bfloat16
        ids = item[T_INPUT_IDS].tolist()
        ref = model.forward_chunk(model.new_cache(), ids, 0)
        want = torch.cat([ref.aux, ref.hidden], dim=1).to(torch.bfloat16).float()
        got = torch.cat([item[T_AUX], item[T_HIDDEN]], dim=1).float()
        err = rel_err(want, got, 4)
        assert err.max() < 0.06 and err.mean() < 0.04, (err.max(0), err.mean(0))
    # And index works, and every trainer's export verifies and holds the loader's bf16 values
    report = index.refresh(out, verify=True)
    assert report.rows == 3 and not report.rejected, report.lines()
    bf16 = {k: ds[i] for i, k in enumerate(ds.keys)}
    for name in ("specforge", "modelopt"):
        summary = export(out, name, tmp_path / name)
        assert summary.ok and summary.exported == 3, summary.lines()
        back = FORMATS[name].read_back(tmp_path / name / FORMATS[name].rel_path(keys[0]))
        want = bf16[keys[0]][T_AUX].view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(back["aux_hidden_state" if name == "specforge"
                                   else "aux_hidden_states"].reshape(want.shape), want)
        assert export(out, name, tmp_path / name).skipped == 3  # the ledger's sums hold
    summary = export(out, "speculators", tmp_path / "speculators")
    assert summary.ok and summary.exported == 3, summary.lines()


# --- export of an fp8 run into a small file system -------------------------------------------

@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A real fp8 run's output dir: 8 example samples through a local farm."""
    from tests.conftest import CACHE
    from tests.support.training_data import produce

    return produce(tmp_path_factory.mktemp("fp8run"), 8, CACHE, store_dtype="fp8_e4m3")


@pytest.fixture
def small_fs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real tmpfs of 4 MB, unmounted afterwards; the export's free-space margin (64 MB, for
    real disks) scaled down to it: 0."""
    import subprocess

    from training.export import runner

    monkeypatch.setattr(runner, "MARGIN_BYTES", 0)
    mnt = tmp_path / "fs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                         capture_output=True, text=True, check=False)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _leave_free(fs: Path, free_bytes: int) -> Path:
    """Fill ``fs`` with a ballast file until ``free_bytes`` (rounded to pages) are left."""
    ballast = fs / "ballast"
    with open(ballast, "ab") as f:
        while (left := shutil.disk_usage(fs).free - free_bytes) > 0:
            f.write(b"\0" * min(left, 1 << 20))
            f.flush()
    return ballast


def test_an_fp8_exports_budget_counts_the_bf16_it_writes(fp8_run: Path, small_fs: Path) -> None:
    from training import fp8
    from training.export.runner import export
    from training.manifest import load_run_info

    # Given a DEST with room for the run's stored (fp8) bytes, not for the bf16 it writes
    stored = sum(p.stat().st_size for p in (fp8_run / "samples").rglob("*.safetensors"))
    _leave_free(small_fs, stored + stored // 10)
    # Then the export refuses up front, with what it needs (bf16: ~1.9x), and writes nothing
    with pytest.raises(ConfigError, match=r"needs about [\d.]+ [kMGT]?B: [\d.]+ [kMGT]?B missing"):
        export(fp8_run, "specforge", small_fs / "dest")
    assert not list((small_fs / "dest").rglob("*.ckpt"))
    # (what it counts: the bf16 the export writes, ~1.9x the fp8 sources)
    info = load_run_info(fp8_run)
    counted = sum(fp8.exported_bytes(info, p) for p in (fp8_run / "samples").rglob("*.safetensors"))
    assert 1.7 * stored < counted < 2 * stored, (counted, stored)


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_full_dest_is_named_whichever_writer_hits_it(fp8_run: Path, small_fs: Path,
                                                        fmt: str) -> None:
    from training.export.runner import export

    dest = small_fs / "dest"
    seen = []

    def fill_after(first: int) -> Callable[[int], None]:
        def progress(n: int) -> None:  # the export's main thread, after each sample
            seen.append(n)
            if len(seen) == first:
                _leave_free(small_fs, 64 << 10)  # room for a directory, not for a sample
        return progress

    # Given a DEST that fills up after the first sample (specforge: torch.save's write fails,
    # which torch reports as "unexpected pos"), or after the last one (speculators: pyarrow's
    # dataset write fails)
    first, raised_by = (1, "unexpected pos") if fmt == "specforge" else (8, "Error writing")
    with pytest.raises(ConfigError) as e:
        export(fp8_run, fmt, dest, jobs=1, throttle_s=0.2, progress=fill_after(first))
    assert raised_by in str(e.value.__cause__), repr(e.value.__cause__)
    # Then the export stops with "DEST is full" and the fix, never torch's or pyarrow's words
    msg = str(e.value)
    assert msg.startswith(f"DEST is full: {dest}"), msg
    assert raised_by not in msg and "Free space" in msg, msg
    assert not [p for p in dest.rglob("*") if TMP_MARK in p.name]
    # And once there is room, the same export finishes and keeps what verified before
    (small_fs / "ballast").unlink()
    summary = export(fp8_run, fmt, dest, jobs=1)
    assert summary.ok and summary.exported + summary.skipped == 8, summary.lines()
    assert summary.skipped >= 1, summary.lines()
