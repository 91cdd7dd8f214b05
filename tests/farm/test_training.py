"""The training side on real farm output (one local farm run of 12 samples per session): index,
loader and exports without Celery; exports that resume, are killed, find damage or share a
destination lose and double nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine_dump.dumpfile import DUMP_SUFFIX, T_HIDDEN, T_INPUT_IDS, is_temp_name
from engine_dump.fingerprint import Fingerprint
from tests.conftest import CACHE
from tests.support.training_data import produce
from training import index, roots
from training.export.ledger import NAME as LEDGER
from training.export.runner import export
from training.loader import HiddenStates
from worker.core.errors import ConfigError
from worker.core.store import OutputStore

N = 12


@pytest.fixture(scope="session")
def farm_output(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """Real output of a local farm (12 example samples), shared by this module's tests."""
    return produce(tmp_path_factory.mktemp("training"), N, CACHE)


@pytest.fixture
def out(farm_output: Path, tmp_path: Path) -> Path:
    """A private copy a test may change."""
    shutil.copytree(farm_output, tmp_path / "out")
    return tmp_path / "out"


def _py(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path.cwd())})


def test_training_imports_and_loads_without_celery_kombu_or_redis(out: Path) -> None:
    # Given a fresh interpreter, When it indexes, loads a sample and exports with training/
    res = _py(f"""
import sys
from pathlib import Path
from training import index, loader
from training.export.runner import export
index.refresh(Path({str(out)!r}))
loader.HiddenStates(Path({str(out)!r}), view="speculators")[0]
export(Path({str(out)!r}), "specforge", Path({str(out)!r}) / ".." / "sf", jobs=1)
print(sorted(m for m in ("celery", "kombu", "redis") if m in sys.modules))""")
    # Then none of Celery, kombu or redis was imported
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_python_m_training_indexes_and_exports_without_the_farms_libraries(
        out: Path, tmp_path: Path) -> None:
    # Given an interpreter where Celery, kombu, redis and transformers cannot be imported (a
    # trainer's machine with hsfarm[training] only)
    blocked = ("celery", "kombu", "redis", "transformers")
    run = (f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); sys.argv[0] = 'x'; "
           "import runpy; runpy.run_module('training', run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}

    def training(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", run, *args], capture_output=True,
                              text=True, timeout=120, env=env)

    # When it indexes and exports with `python -m training`
    res = training("index", "--from", str(out), "--no-progress")
    assert res.returncode == 0 and f"indexed: {N} samples" in res.stdout, res.stderr
    res = training("export", "--to", "modelopt", str(tmp_path / "mo"), "--from", str(out),
                   "--no-progress")
    # Then both run, as the producer's commands do
    assert res.returncode == 0 and f"exported: {N} samples" in res.stdout, res.stderr
    res = training("export", "--to", "modelopt", str(tmp_path / "x"), "--from", str(tmp_path))
    assert res.returncode == 2 and "not an hsfarm output dir" in res.stderr


def test_manifest_records_semantics_and_the_final_norm(out: Path) -> None:
    m = json.loads((out / "manifest.json").read_text())
    assert m["tensors"]["aux_layers_sglang"] == [2, 4, 5]
    assert m["tensors"]["aux_layers_output_0based"] == [1, 3, 4]
    assert m["final_norm"]["source_tensor"] == "model.norm.weight"
    model_norm = load_file(str(CACHE / "tiny-llama-v2" / "model.safetensors"))["model.norm.weight"]
    assert torch.equal(load_file(str(out / "final_norm.safetensors"))["weight"], model_norm)


def test_an_old_manifest_without_the_new_fields_still_opens_with_the_same_id(out: Path) -> None:
    # Given a manifest as written before this change (no tensors, no final_norm)
    m = json.loads((out / "manifest.json").read_text())
    old = {k: v for k, v in m.items() if k not in ("tensors", "final_norm")}
    (out / "manifest.json").write_text(json.dumps(old))
    fp = Fingerprint.from_json(old["fingerprint"])
    # When a worker's store opens it, Then it is accepted, and the id is the recorded one
    OutputStore(out, fp).open()
    assert fp.id == old["fingerprint_id"]


def test_index_refresh_with_nothing_new_reads_no_tensor_data(out: Path) -> None:
    # Given an index of every sample
    first = index.refresh(out)
    assert (first.rows, first.new, first.rejected) == (N, N, [])
    counts = index.read_counts(out).copy()
    # When every file's tensor data is overwritten in place (same size, same mtime)
    for p in roots.sample_files(out):
        st = p.stat()
        with open(p, "r+b") as f:
            f.seek(st.st_size - 64)
            f.write(b"\xff" * 64)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = index.refresh(out)
    # Then a refresh reads nothing (it would have found the damage) and keeps the counts
    assert (again.unchanged, again.new, again.tensor_bytes_read, again.rejected) == (N, 0, 0, [])
    assert np.array_equal(index.read_counts(out), counts)
    # And a file that changed is read again, checked, and rejected with its reason
    victim = next(roots.sample_files(out))
    os.utime(victim)
    third = index.refresh(out, verify=True)
    assert len(third.rejected) == 1 and "checksum" in third.rejected[0][1]


def test_the_loaders_read_ahead_runs_beside_it_and_leaves_no_descriptor(out: Path) -> None:
    import threading

    index.refresh(out)
    ds = HiddenStates(out)
    fds = len(os.listdir("/proc/self/fd"))
    # When every sample is read (each asks for its whole file from a thread of its own)
    items = [ds[i] for i in range(len(ds))]
    for t in threading.enumerate():
        if t.name == "hsfarm-read-ahead":
            t.join(timeout=30)
    # Then the tensors are readable, and once they are dropped no descriptor is left: each
    # read-ahead closed its own (a map holds one while its tensors live: Python's mmap)
    assert all(int(item[T_INPUT_IDS].numel()) > 0 for item in items)
    del items
    assert len(os.listdir("/proc/self/fd")) == fds


def test_loader_views_hold_our_tensors_without_a_copy(out: Path) -> None:
    index.refresh(out)
    ours, lazy = HiddenStates(out), HiddenStates(out, lazy=True)
    sf, mo, sp = (HiddenStates(out, v) for v in ("specforge", "modelopt", "speculators"))
    w = load_file(str(out / "final_norm.safetensors"))["weight"].float()
    for i in range(len(ours)):
        o = ours[i]
        assert all(torch.equal(o[k], v) for k, v in lazy[i].items())
        assert torch.equal(sf[i]["hidden_state"][0], o["hidden_state"])
        assert sf[i]["input_ids"].shape == o["input_ids"].shape  # never a batch dim on ids
        assert torch.equal(mo[i]["aux_hidden_states"], o["aux_hidden_state"])
        s = sp[i]["hidden_states"]
        assert torch.equal(s[:, :3].reshape(len(s), -1), o["aux_hidden_state"])
        x = s[:, 3].float()
        normed = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(normed, o["hidden_state"].float(), rtol=2 ** -7, atol=1e-2)
    assert ours.lengths == [len(ours[i]["input_ids"]) for i in range(len(ours))]


def test_export_verifies_resumes_and_deletes_sources_only_after(out: Path, tmp_path: Path) -> None:
    # Given an export to Model-Optimizer's container
    first = export(out, "modelopt", tmp_path / "mo", jobs=2)
    assert (first.exported, first.failed) == (N, [])
    # When it runs again, Then every verified output is skipped
    again = export(out, "modelopt", tmp_path / "mo", jobs=2)
    assert (again.exported, again.skipped) == (0, N)
    # And with --delete-source each source goes only once its export is in the ledger
    moved = export(out, "specforge", tmp_path / "sf", jobs=2, delete_source=True)
    ledger = [json.loads(x) for x in (tmp_path / "sf" / LEDGER).read_text().splitlines()]
    assert moved.deleted_sources == N == len(ledger)
    assert not list(roots.sample_files(out))
    for e in ledger:
        obj = torch.load(tmp_path / "sf" / e["path"], weights_only=True)
        assert obj["hidden_state"].shape[0] == 1 and obj["input_ids"].dim() == 1


def test_sources_left_after_their_ledger_line_are_deleted_on_resume(out: Path,
                                                                   tmp_path: Path) -> None:
    # Given every sample exported and in the ledger, its source still there (as after a crash
    # between the ledger line and the unlink)
    assert export(out, "modelopt", tmp_path / "mo", jobs=2).exported == N
    # When the export is resumed with --delete-source
    resumed = export(out, "modelopt", tmp_path / "mo", jobs=2, delete_source=True)
    # Then nothing is exported again and every exported sample's source is removed
    assert (resumed.exported, resumed.skipped, resumed.deleted_sources) == (0, N, N)
    assert not list(roots.sample_files(out))


def test_export_refuses_to_start_without_room_and_says_how_much(out: Path) -> None:
    dest = Path("/dev/shm") / f"hsfarm-test-{os.getpid()}"
    dest.mkdir()
    small = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(dest)],
                           capture_output=True)
    try:
        if small.returncode != 0:
            pytest.skip("cannot mount a small tmpfs here")
        # When the export starts, Then it is refused with each size in a unit that shows it
        # (a tmpfs of 1 MiB and a few MB of samples: never "0.00 GB")
        with pytest.raises(ConfigError, match=r"[\d.]+ (kB|MB) free; exporting 12 samples "
                           r"needs about [\d.]+ MB: [\d.]+ MB missing") as refused:
            export(out, "specforge", dest / "x")
        assert "0.00" not in str(refused.value)
    finally:
        subprocess.run(["umount", str(dest)], capture_output=True)
        dest.rmdir()


def test_sigkill_mid_export_loses_nothing(out: Path, tmp_path: Path) -> None:
    # Given an export that is SIGKILLed while samples are in flight
    dest = tmp_path / "sp"
    proc = subprocess.Popen([sys.executable, "-c", f"""
from pathlib import Path
from training.export.runner import export
export(Path({str(out)!r}), "speculators", Path({str(dest)!r}), jobs=2, delete_source=True,
       throttle_s=0.3)"""], env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    ledger = dest / LEDGER
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
            ledger.exists() and ledger.read_bytes().count(b"\n") >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = ledger.read_bytes().count(b"\n")
    assert 3 <= done_before < N, "the kill must land mid-export"
    # When the export is run again
    summary = export(out, "speculators", dest, jobs=2, delete_source=True)
    # Then every sample is exported exactly once, numbered 0..N-1, and no temp file is left
    assert summary.ok and summary.exported + summary.skipped == N
    rows = [json.loads(x) for x in ledger.read_text().splitlines()]
    assert sorted(r["number"] for r in rows) == list(range(N))
    assert len({r["key"] for r in rows}) == N
    assert not [p for p in dest.rglob("*") if is_temp_name(p.name)]
    assert not list(roots.sample_files(out))  # every source gone, each after its export


def test_cli_index_and_export(out: Path, tmp_path: Path) -> None:
    env = {**os.environ, "FARM_OUTPUT_DIR": str(out)}
    run = [sys.executable, "-m", "producer"]
    res = subprocess.run([*run, "index", "--no-progress", "--draft-vocab-size", "32",
                          "--target-vocab-size", "642"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert f"indexed: {N} samples ({N} new" in res.stdout and (out / "vocab_mapping-32.pt").exists()
    res = subprocess.run([*run, "export", "--to", "speculators", str(tmp_path / "sp"),
                          "--no-progress"], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and f"exported: {N} samples" in res.stdout, res.stderr
    bad = subprocess.run([*run, "export", "--to", "specforge", str(tmp_path / "x"), "--from",
                          str(tmp_path)], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "not an hsfarm output dir" in bad.stderr


def test_a_damaged_source_fails_its_export_and_is_kept(out: Path, tmp_path: Path) -> None:
    # Given one source file with a flipped byte in its hidden states
    victim = sorted(roots.sample_files(out))[0]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x01
    victim.write_bytes(bytes(data))
    # When exported with --delete-source
    summary = export(out, "modelopt", tmp_path / "mo", jobs=2, delete_source=True)
    # Then that sample fails with the reason, its source stays, and nothing of it is exported
    assert [k for k, _ in summary.failed] == [victim.stem]
    assert "differs from source" in summary.failed[0][1]
    assert victim.exists() and summary.exported == N - 1
    assert not list((tmp_path / "mo").rglob(f"{victim.stem}*"))


def _re_extract(path: Path) -> None:
    """Replace a final file as a re-extraction of a fixed record would: same key and size, new
    hidden states, their checksums recorded (written aside, then renamed over, as the store)."""
    from worker.core import checksums as ck
    from worker.core import tensorfile

    tf = tensorfile.read(path)
    arrays = {k: t.array.copy() for k, t in tf.tensors.items()}
    arrays[T_HIDDEN][0, :4] ^= 0x0001  # a different extraction, bit for bit
    meta = {**tf.metadata, **ck.checksum_metadata(
        {k: ck.tensor_checksum(np.ascontiguousarray(a).data) for k, a in arrays.items()})}
    tmp = path.with_name(path.name + ".fixed")
    tensorfile.write(tmp, {k: tensorfile.Tensor(t.dtype, arrays[k])
                           for k, t in tf.tensors.items()}, meta)
    os.replace(tmp, path)


def _hidden_of(path: Path) -> np.ndarray:
    return np.asarray(load_file(str(path))[T_HIDDEN].view(torch.int16).numpy())


def test_a_changed_source_is_exported_again_and_deleted_only_once_its_bytes_are(
        out: Path, tmp_path: Path) -> None:
    # Given an export to SpecForge, then one sample re-extracted (a fixed record: new bytes,
    # same size)
    dest = tmp_path / "sf"
    assert export(out, "specforge", dest).exported == N
    victim = sorted(roots.sample_files(out))[3]
    _re_extract(victim)
    fixed = _hidden_of(victim)
    # When exported again with --delete-source
    again = export(out, "specforge", dest, delete_source=True)
    # Then the fixed sample is exported again, its new bytes are what DEST holds, and its
    # source is gone only now that they are
    assert (again.exported, again.skipped, again.failed) == (1, N - 1, [])
    got = torch.load(dest / "samples" / victim.parent.name / f"{victim.stem}.ckpt",
                     weights_only=True)["hidden_state"][0]
    assert np.array_equal(got.view(torch.int16).numpy(), fixed)
    assert again.deleted_sources == N and not victim.exists()


def test_a_damaged_destination_is_found_and_rewritten(out: Path, tmp_path: Path) -> None:
    # Given an export, then one byte flipped in one exported file's hidden states
    dest = tmp_path / "mo"
    assert export(out, "modelopt", dest).exported == N
    victim = sorted(dest.rglob("*.pt"))[2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    # When exported again
    again = export(out, "modelopt", dest)
    # Then the damaged file is rewritten from its source and reads back as the source
    assert (again.exported, again.skipped, again.failed) == (1, N - 1, [])
    src = load_file(str(next(p for p in roots.sample_files(out) if p.stem == victim.stem)))
    got = torch.load(victim, weights_only=True)
    assert torch.equal(got["hidden_states"], src[T_HIDDEN])


def _speculators_rows(dest: Path) -> dict[int, str]:
    """hs_{i} -> the sample key its file holds, read from the files themselves."""
    from safetensors import safe_open

    rows = {}
    for p in (dest / "hidden_states").glob("hs_*.safetensors"):
        with safe_open(str(p), framework="np") as f:
            rows[int(p.stem[3:])] = f.metadata()["sample_key"]
    return rows


def test_a_missing_numbered_file_is_exported_again_in_place(out: Path, tmp_path: Path) -> None:
    # Given a speculators export, then hs_5 removed
    dest = tmp_path / "sp"
    assert export(out, "speculators", dest).exported == N
    before = _speculators_rows(dest)
    (dest / "hidden_states" / "hs_5.safetensors").unlink()
    # When exported again (twice)
    again = export(out, "speculators", dest)
    third = export(out, "speculators", dest)
    # Then that sample is written again as hs_5: the rows stay 0..N-1, each key once
    assert (again.exported, again.failed) == (1, [])
    assert (third.exported, third.skipped, third.failed) == (0, N, [])
    assert _speculators_rows(dest) == before
    assert _arrow_rows(dest) == N


def _arrow_rows(dest: Path) -> int:
    import pyarrow as pa

    from training.export.speculators_dataset import ARROW

    with pa.OSFile(str(dest / ARROW)) as f:
        return int(pa.ipc.open_stream(f).read_all().num_rows)


def test_a_numbered_file_lost_with_its_source_is_reported_and_the_rows_closed_up(
        out: Path, tmp_path: Path) -> None:
    # Given a speculators export that deleted its sources, then hs_3 removed
    dest = tmp_path / "sp"
    assert export(out, "speculators", dest, delete_source=True).deleted_sources == N
    lost = _speculators_rows(dest)[3]
    (dest / "hidden_states" / "hs_3.safetensors").unlink()
    # When exported again, through the CLI
    res = subprocess.run([sys.executable, "-m", "producer", "export", "--to", "speculators",
                          str(dest), "--from", str(out), "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    # Then it says which sample is lost and why, without a traceback (exit 1), and the other
    # samples are rows 0..N-2, each once
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and f"failed {lost}:" in res.stdout
    assert "source" in res.stdout
    rows = _speculators_rows(dest)
    assert sorted(rows) == list(range(N - 1)) and len(set(rows.values())) == N - 1
    assert lost not in rows.values() and _arrow_rows(dest) == N - 1
    ledger = [json.loads(x) for x in (dest / LEDGER).read_text().splitlines()]
    live: dict[str, dict[str, object]] = {}
    for e in ledger:
        live.pop(e["key"], None) if e.get("removed") else live.__setitem__(e["key"], e)
    assert {e["number"]: k for k, e in live.items()} == rows


def test_two_exports_into_one_dest_at_once_lose_and_double_nothing(out: Path,
                                                                 tmp_path: Path) -> None:
    # Given two export processes with --delete-source into one DEST, started together
    dest, go = tmp_path / "sp", tmp_path / "go"
    code = f"""
import sys, time
from pathlib import Path
from training.export.runner import export
while not Path({str(go)!r}).exists():
    time.sleep(0.01)
try:
    s = export(Path({str(out)!r}), "speculators", Path({str(dest)!r}), jobs=2,
               delete_source=True, throttle_s=0.1)
except Exception as e:
    print("refused:", e)
    sys.exit(3)
print("exported", s.exported, "failed", s.failed)"""
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    time.sleep(3)  # both interpreters have imported and wait for the signal
    go.touch()
    results = [(p.wait(120), *p.communicate()) for p in procs]
    # Then every sample is in DEST exactly once, as one row, and no source is left
    rows = _speculators_rows(dest)
    assert sorted(rows) == list(range(N)), results
    assert len(set(rows.values())) == N, results
    assert not list(roots.sample_files(out)), results
    lines = [json.loads(x) for x in (dest / LEDGER).read_text().splitlines()]
    assert len(lines) == N and len({e["number"] for e in lines}) == N, (results, lines)
    # And one export ran while the other said why it did not
    assert sorted(rc for rc, _, _ in results) == [0, 3], results
    assert any("another export" in o for _, o, _ in results), results


def test_an_export_into_a_dest_in_use_refuses_with_the_reason(out: Path, tmp_path: Path) -> None:
    import fcntl

    from training.export.lock import LOCK_NAME

    # Given a DEST whose lock another process holds
    dest = tmp_path / "sf"
    dest.mkdir()
    with open(dest / LOCK_NAME, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        # When the CLI exports into it
        res = subprocess.run([sys.executable, "-m", "producer", "export", "--to", "specforge",
                              str(dest), "--from", str(out), "--no-progress"],
                             capture_output=True, text=True, timeout=120)
    # Then it exits 2 with the reason, having touched nothing
    assert res.returncode == 2 and "another export" in res.stderr, res.stdout + res.stderr
    assert not (dest / LEDGER).exists()


def test_index_and_export_take_several_hosts_roots_and_each_sample_once(
        out: Path, tmp_path: Path) -> None:
    # Given one run's output over two roots (two hosts' dirs gathered in one place): half the
    # samples moved to the second root, one of them also left in the first (done twice)
    other = tmp_path / "hostB"
    (other / "samples").mkdir(parents=True)
    for p in out.iterdir():
        if p.is_file():
            shutil.copy2(p, other / p.name)
    files = sorted((out / "samples").rglob(f"*{DUMP_SUFFIX}"))
    for p in files[: N // 2]:
        (other / "samples" / p.parent.name).mkdir(exist_ok=True)
        shutil.copy2(p, other / "samples" / p.parent.name / p.name)
        if p != files[0]:
            p.unlink()
    run = [sys.executable, "-m", "training"]
    # When both are indexed and exported
    res = subprocess.run([*run, "index", "--no-progress", "--from", str(out), "--from",
                          str(other)], capture_output=True, text=True)
    # Then each sample is indexed once, and the choice for the one held twice is said
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"indexed: {N} samples ({N} new" in res.stdout, res.stdout
    assert "in two roots, kept once: 1 samples" in res.stdout, res.stdout
    key = files[0].name.removesuffix(DUMP_SUFFIX)
    assert f"{key}: kept {files[0]}, left out {other}" in res.stdout
    rows = index.read_rows(out)
    assert len(rows) == N and all((out / r["path"]).is_file() for r in rows.values())
    res = subprocess.run([*run, "export", "--to", "speculators", str(tmp_path / "sp"),
                          "--no-progress", "--from", str(out), "--from", str(other)],
                         capture_output=True, text=True)
    assert res.returncode == 0 and f"exported: {N} samples" in res.stdout, res.stderr
    assert "kept once: 1 samples" in res.stdout
    # And a root of another run is refused
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["run_nonce"] = "another"
    (other / "manifest.json").write_text(json.dumps(manifest))
    bad = subprocess.run([*run, "index", "--no-progress", "--from", str(out), "--from",
                          str(other)], capture_output=True, text=True)
    assert bad.returncode == 2 and "roots of one training set must be one run's" in bad.stderr
