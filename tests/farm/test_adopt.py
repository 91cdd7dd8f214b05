"""``adopt``: files of earlier runs, written by the reference model in each format, taken into
a run only when the live server reproduces them; damaged and hostile ones refused one by one.

One Redis and one reference server for the module; each test its own output dir (a run).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_dump.dumpfile import (
    AUX_LAYERS,
    DTYPE_FP8,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    T_INPUT_IDS,
    T_LOSS_MASK,
    is_temp_name,
)
from engine_dump.fingerprint import default_layers_to_capture
from producer import cli
from producer.adopt.procedure import Report, Run
from producer.adopt.procedure import adopt as run_adopt
from producer.localfarm.farm import LocalFarm, wait_until
from sglang_patch.tiny_model import ensure_tiny_model
from tests.conftest import CACHE, EXAMPLES, FarmFactory, wait_finished
from tests.support import adopt_sources as srcs
from training import index as training_index
from worker.core import outdir, tensorfile
from worker.core.run import run_id_of
from worker.core.samples import sample_refs
from worker.core.settings import Settings
from worker.server.chat import ChatTokenizer
from worker.server.fingerprint import load_run
from worker.state import lease as leases

N_DATA, N_SOURCE = 8, 6
N_COPIES = 300  # copies of one source file: a scan that takes a while


@pytest.fixture(scope="module")
def farm(module_farm_factory: FarmFactory) -> LocalFarm:
    return module_farm_factory("adopt", chunked_prefill_size=64)


@pytest.fixture(scope="module")
def data(farm: LocalFarm) -> tuple[Path, list[dict[str, Any]]]:
    records = json.loads(EXAMPLES.read_text())[:N_DATA]
    path = farm.work_dir / "data.json"
    path.write_text(json.dumps(records))
    return path, records


@pytest.fixture(scope="module")
def chat(farm: LocalFarm, tiny_model: Path) -> ChatTokenizer:
    s = farm.settings()
    return ChatTokenizer.from_pretrained(str(tiny_model), s.max_tokens, s.overlong)


@pytest.fixture(scope="module")
def extracted(tiny_model: Path, data: tuple[Path, list[dict[str, Any]]],
              chat: ChatTokenizer) -> list[srcs.Extracted]:
    return srcs.extract(tiny_model, data[1], chat)


def adopt(farm: LocalFarm, source: Path, data: Path, out: Path, *args: str,
          wait: bool = True) -> Any:
    """``python -m producer adopt`` into the run of ``out`` (torch importable)."""
    argv = [sys.executable, "-m", "producer", "adopt", str(source), "--data", str(data),
            "--no-progress", "--seed", "1", *args]
    env = {**farm.env(), "FARM_OUTPUT_DIR": str(out)}
    if not wait:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def adopt_here(farm: LocalFarm, monkeypatch: pytest.MonkeyPatch,
               capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    """``adopt`` run in this process (torch and transformers imported once for the module)."""
    def run(source: Path, data: Path, out: Path, *args: str) -> Result:
        for k, v in farm.env().items():
            if k.startswith("FARM_") or k == "REDIS_URL":
                monkeypatch.setenv(k, v)
        monkeypatch.setenv("FARM_OUTPUT_DIR", str(out))
        capsys.readouterr()
        code = cli.main(["adopt", str(source), "--data", str(data), "--no-progress",
                         "--seed", "1", *args])
        got = capsys.readouterr()
        return Result(code, got.out, got.err)

    return run


def adopt_direct(farm: LocalFarm, source: Path, data: Path, out: Path) -> Report:
    """``producer.adopt.procedure.adopt`` called directly, with a run of its own (thread-safe)."""
    settings = Settings.from_env({**farm.env(), "FARM_OUTPUT_DIR": str(out)})
    model_path, chat, fp = load_run(settings)
    return run_adopt(Run(settings, chat, fp, model_path), source, data, progress=False)


def finals(out: Path) -> dict[str, Path]:
    return {p.name: p for p in (out / "samples").rglob("*.safetensors")}


def assert_bit_equal(out: Path, items: list[srcs.Extracted]) -> None:
    """Every final file holds exactly one source item's ids and states, bit for bit."""
    by_ids = {tuple(e.ids): e for e in items}
    files = finals(out)
    assert len(files) == len(items)
    for p in files.values():
        tf = tensorfile.read(p)
        e = by_ids[tuple(tf.tensors[T_INPUT_IDS].array.tolist())]
        assert np.array_equal(tf.tensors[T_HIDDEN].array, srcs.bits(e.hidden))
        assert np.array_equal(tf.tensors[T_AUX].array, srcs.bits(e.aux))
        assert tf.metadata["adopted_format"] in ("specforge", "hsfarm", "torch")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the hostile legacy pickle
def test_specforge_source_adopted_bit_equal_then_the_run_finishes(
        farm: LocalFarm, data: tuple[Path, list[dict[str, Any]]],
        extracted: list[srcs.Extracted], tmp_path: Path,
        adopt_here: Callable[..., Result]) -> None:
    src = tmp_path / "specforge"
    srcs.write_specforge(src, extracted[:N_SOURCE])
    marker = tmp_path / "pwned"
    expect = srcs.write_bad(src, extracted[N_SOURCE], marker)
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    res = adopt_here(src, data[0], farm.output_dir)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr  # some refused, the rest adopted
    assert f"adopted: {N_SOURCE} samples\n" in out, out
    assert f"refused: {len(expect)} files\n" in out, out
    for name, why in expect.items():
        assert any(line.startswith(f"  {name}: ") and why in line for line in out.splitlines()), (
            name, out)
    assert "compatibility check" in out and "passed" in out
    assert not marker.exists()  # nothing of the hostile pickles ran
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before  # only read
    assert_bit_equal(farm.output_dir, extracted[:N_SOURCE])
    manifest = json.loads((farm.output_dir / "manifest.json").read_text())
    assert manifest["adoptions"][0]["adopted"] == N_SOURCE
    # again: nothing twice
    again = adopt_here(src, data[0], farm.output_dir)
    assert "adopted: 0 samples\n" in again.stdout, again.stdout
    assert f"already done: {N_SOURCE} samples\n" in again.stdout, again.stdout
    # enqueue publishes only the rest; workers do them; audit finds the run whole
    enq = farm.cli("enqueue", str(data[0]), "--no-progress")
    assert f"published: {N_DATA - N_SOURCE}\n" in enq.stdout, enq.stdout + enq.stderr
    assert f"already done: {N_SOURCE}\n" in enq.stdout
    farm.start_worker("w1", concurrency=1)
    wait_finished(farm, N_DATA, timeout_s=120)
    # an adopted file lost: adopted again, after the run's canary (the worker recorded it)
    lost = next(p for p in finals(farm.output_dir).values()
                if "adopted_from" in tensorfile.header_metadata(p))
    lost.unlink()
    again = adopt_here(src, data[0], farm.output_dir)
    assert "canary passed: 3 prompts" in again.stdout, again.stdout + again.stderr
    assert "adopted: 1 sample\n" in again.stdout, again.stdout
    audited = farm.cli("audit")
    assert audited.returncode == 0, audited.stdout + audited.stderr
    assert f"whole: {N_DATA} " in audited.stdout and f"adopted: {N_SOURCE}\n" in audited.stdout
    status = farm.cli("status", "--json")
    assert json.loads(status.stdout.splitlines()[-1])["done"] == N_DATA
    report = training_index.refresh(farm.output_dir)
    assert report.rows == N_DATA and not report.rejected, report.lines()


def test_dry_run_adopts_nothing_and_another_template_matches_nothing(
        data: tuple[Path, list[dict[str, Any]]], extracted: list[srcs.Extracted],
        tiny_model: Path, tmp_path: Path, adopt_here: Callable[..., Result]) -> None:
    srcs.write_specforge(tmp_path / "sf", extracted[:3])
    res = adopt_here(tmp_path / "sf", data[0], tmp_path / "out", "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "would adopt: 3 samples\n" in res.stdout, res.stdout
    assert not (tmp_path / "out").exists() or not finals(tmp_path / "out")
    # a source whose tool rendered the chat another way: its ids are no record's
    other = ChatTokenizer.from_pretrained(str(tiny_model), 8192, "reject")
    other.tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                               "{% endfor %}")
    srcs.write_specforge(tmp_path / "tpl", srcs.extract(tiny_model, data[1][:2], other))
    res = adopt_here(tmp_path / "tpl", data[0], tmp_path / "out")
    assert res.returncode == 1 and "no file matches a record" in res.stdout, res.stdout
    assert "adopted: 0 samples\n" in res.stdout and "refused: 2 files\n" in res.stdout


def test_other_checkpoint_refused_as_a_whole(
        data: tuple[Path, list[dict[str, Any]]], chat: ChatTokenizer, tmp_path: Path,
        adopt_here: Callable[..., Result]) -> None:
    other = ensure_tiny_model(CACHE, seed=1)
    src = tmp_path / "foreign"
    srcs.write_specforge(src, srcs.extract(other, data[1][:4], chat))
    res = adopt_here(src, data[0], tmp_path / "out")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "FAILED" in res.stdout and "another model or checkpoint" in res.stdout, res.stdout
    assert "<-- differs" in res.stdout
    assert not finals(tmp_path / "out")


def test_off_by_one_layers_diagnosed(
        data: tuple[Path, list[dict[str, Any]]], chat: ChatTokenizer,
        tiny_model: Path, tmp_path: Path, adopt_here: Callable[..., Result]) -> None:
    layers = default_layers_to_capture(8)  # (2, 4, 5): the run's
    src = tmp_path / "shifted"
    items = srcs.extract(tiny_model, data[1][:4], chat, layers=tuple(i + 1 for i in layers))
    srcs.write_specforge(src, items)
    res = adopt_here(src, data[0], tmp_path / "out", "--check", "2")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "off-by-one" in res.stdout and "output of layer 4" in res.stdout, res.stdout
    assert not finals(tmp_path / "out")


def test_hsfarm_and_torch_sources_beside_a_worker_and_unknown_format(
        farm: LocalFarm, data: tuple[Path, list[dict[str, Any]]], extracted: list[srcs.Extracted],
        tmp_path: Path, adopt_here: Callable[..., Result]) -> None:
    srcs.write_hsfarm(tmp_path / "hs", extracted[:2])
    srcs.write_hsfarm_damaged(tmp_path / "hs", extracted[4], extracted[5])
    res = adopt_here(tmp_path / "hs", data[0], tmp_path / "out")
    assert res.returncode == 1 and "adopted: 2 samples\n" in res.stdout, res.stdout + res.stderr
    assert re.search(r"^  samples/00/flipped.safetensors: checksum of \w+ differs", res.stdout,
                     re.M), res.stdout
    assert re.search(r"^  samples/00/cut.safetensors: unreadable: .*truncated", res.stdout,
                     re.M), res.stdout
    srcs.write_torch(tmp_path / "pt", extracted[2:4])
    torch_args = ("--format", "torch", "--key", "input_ids=ids", "--key", "hidden_state=final",
                  "--key", "aux_hidden_state=aux0,aux1,aux2")
    # a worker holds sample 2's lease (it is extracting it): adopt leaves that one to it
    key = list(sample_refs(data[0], 1 << 20, [], []))[2].key
    lease = leases.try_acquire(farm.redis(), leases.lease_name(run_id_of(tmp_path / "out"), key),
                               30)
    assert isinstance(lease, leases.Lease)
    try:
        res = adopt_here(tmp_path / "pt", data[0], tmp_path / "out", *torch_args)
    finally:
        lease.release()
    assert "adopted: 1 sample\n" in res.stdout, res.stdout
    assert "left to workers: 1 file\n" in res.stdout, res.stdout
    assert f"{key}.safetensors" not in finals(tmp_path / "out")
    res = adopt_here(tmp_path / "pt", data[0], tmp_path / "out", *torch_args)
    assert res.returncode == 0 and "adopted: 1 sample\n" in res.stdout, res.stdout + res.stderr
    assert_bit_equal(tmp_path / "out", extracted[:4])
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "x.npy").write_bytes(b"\0" * 8)
    res = adopt_here(tmp_path / "odd", data[0], tmp_path / "out")
    assert res.returncode == 2 and "found 1 x .npy" in res.stderr, res.stdout + res.stderr


def test_sigkill_mid_adopt_then_two_at_once(
        farm: LocalFarm, data: tuple[Path, list[dict[str, Any]]],
        extracted: list[srcs.Extracted], tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    srcs.write_specforge(src, extracted[:N_SOURCE])
    slow = {**farm.env(), "FARM_OUTPUT_DIR": str(out), "FARM_DEBUG_WRITE_DELAY_S": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "producer", "adopt", str(src), "--data",
                             str(data[0]), "--no-progress", "--jobs", "1"], env=slow,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_until(lambda: any(is_temp_name(p.name) for p in out.rglob("*"))
                   and len(finals(out)) >= 1, 120, "adopt to be writing its second file")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    n_before = len(finals(out))
    # two at once (threads of this process, each with its own tokenizer): the lock orders them
    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda _: adopt_direct(farm, src, data[0], out), range(2)))
    adopted = [r.adopted for r in reports]
    texts = ["\n".join(r.lines()) for r in reports]
    assert sum(adopted) == N_SOURCE - n_before, texts
    assert min(adopted) == 0  # the lock: one of them did it all, the other found it done
    assert_bit_equal(out, extracted[:N_SOURCE])
    assert not [p for p in out.rglob("*") if is_temp_name(p.name)]


def test_adopt_into_an_fp8_run_writes_what_the_hook_writes(
        data: tuple[Path, list[dict[str, Any]]], extracted: list[srcs.Extracted],
        tmp_path: Path) -> None:
    from engine_dump import fp8 as hook_fp8
    from tests.support.faults import count_line, running_farm

    env = {"FARM_STORE_DTYPE": "fp8_e4m3"}
    with running_farm(tmp_path, server_args=["--dump-dtype", "fp8_e4m3"], env=env) as farm:
        # Given bf16 files of another tool and an fp8 run
        src, out = tmp_path / "sf", farm.output_dir
        srcs.write_specforge(src, extracted[:N_SOURCE])
        # When they are adopted
        res = adopt(farm, src, data[0], out)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"adopted: {N_SOURCE} samples\n" in res.stdout, res.stdout
        # Then each file holds the hook's quantization of the source's states, byte for byte
        by_ids = {tuple(e.ids): e for e in extracted[:N_SOURCE]}
        files = finals(out)
        assert len(files) == N_SOURCE
        for p in files.values():
            tf = tensorfile.read(p)
            e = by_ids[tuple(tf.tensors[T_INPUT_IDS].array.tolist())]
            for name, scale, states, layers in (
                    (T_HIDDEN, T_HIDDEN_SCALE, e.hidden, 1),
                    (T_AUX, T_AUX_SCALE, e.aux, AUX_LAYERS)):
                q, s = hook_fp8.quantize(states, layers)
                assert tf.tensors[name].dtype == "F8_E4M3"
                assert np.array_equal(tf.tensors[name].array, q.numpy())
                assert np.array_equal(tf.tensors[scale].array, s.numpy())
        # And a bf16 file at a final path with the run's fingerprint id and its record's hash
        # (as a writer of the wrong dtype leaves one) is not done: adopted again
        p = next(iter(files.values()))
        tf = tensorfile.read(p)
        e = by_ids[tuple(tf.tensors[T_INPUT_IDS].array.tolist())]
        tensorfile.write(p, {T_INPUT_IDS: tf.tensors[T_INPUT_IDS],
                             T_LOSS_MASK: tf.tensors[T_LOSS_MASK],
                             T_HIDDEN: tensorfile.Tensor("BF16", srcs.bits(e.hidden)),
                             T_AUX: tensorfile.Tensor("BF16", srcs.bits(e.aux))}, tf.metadata)
        again = adopt(farm, src, data[0], out)
        assert "adopted: 1 sample\n" in again.stdout, again.stdout + again.stderr
        assert f"already done: {N_SOURCE - 1} samples\n" in again.stdout, again.stdout
        assert tensorfile.read_header(p).tensors[T_HIDDEN].dtype == "F8_E4M3"
        # And enqueue, workers and audit take them as the run's own
        enq = farm.cli("enqueue", str(data[0]), "--no-progress")
        assert count_line(enq.stdout, "already done") == N_SOURCE, enq.stdout + enq.stderr
        assert count_line(enq.stdout, "published") == N_DATA - N_SOURCE, enq.stdout
        farm.start_worker("w1", concurrency=2)
        wait_finished(farm, N_DATA, timeout_s=180)
        audited = farm.cli("audit")
        assert audited.returncode == 0, audited.stdout + audited.stderr
        assert f"whole: {N_DATA} " in audited.stdout, audited.stdout
        # And that fp8 run, as SOURCE, is adopted into a new fp8 run: its stored e4m3 values
        # and scales copied as they are
        again_out = tmp_path / "out2"
        res = adopt(farm, out, data[0], again_out)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"adopted: {N_DATA} samples\n" in res.stdout, res.stdout
        stored = {p.name: tensorfile.read(p).tensors for p in finals(out).values()}
        for name, p in finals(again_out).items():
            got = tensorfile.read(p)
            assert got.metadata["adopted_source_dtype"] == DTYPE_FP8
            for t in (T_HIDDEN, T_HIDDEN_SCALE, T_AUX, T_AUX_SCALE):
                assert got.tensors[t].dtype == stored[name][t].dtype
                assert np.array_equal(got.tensors[t].array, stored[name][t].array), (name, t)
        assert len(finals(again_out)) == N_DATA


def test_odd_entries_in_source_are_refused_by_name_and_enqueue_runs_during_the_scan(
        farm: LocalFarm, data: tuple[Path, list[dict[str, Any]]],
        extracted: list[srcs.Extracted], tiny_model: Path, tmp_path: Path) -> None:
    import shutil
    import threading

    # Given an hsfarm source with two good files and copies of one (a scan that takes a
    # while), a FIFO named like a file, and a link to a file outside it
    src, out = tmp_path / "hs", tmp_path / "out"
    srcs.write_hsfarm(src, extracted[:2])
    shard = src / "samples" / "00"
    for i in range(N_COPIES):
        shutil.copy(shard / "s0.safetensors", shard / f"z{i:03d}.safetensors")
    srcs.write_hsfarm(tmp_path / "elsewhere", extracted[2:3])
    os.mkfifo(shard / "fifo.safetensors")
    (shard / "outside.safetensors").symlink_to(
        tmp_path / "elsewhere" / "samples" / "00" / "s0.safetensors")
    # When adopt runs, its server stopped (its check waits on it) once its scan began
    server = farm.procs["server"]
    argv = [sys.executable, "-m", "producer", "adopt", str(src), "--data", str(data[0]),
            "--seed", "1"]
    proc = subprocess.Popen(argv, env={**farm.env(), "FARM_OUTPUT_DIR": str(out)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    pipe = proc.stderr
    assert pipe is not None
    threading.Thread(target=lambda: err.extend(iter(lambda: pipe.read(1), "")),
                     daemon=True).start()
    try:
        wait_until(lambda: "match:" in "".join(err), 60, "adopt to begin its scan")
        server.kill(signal.SIGSTOP)
        # Then its scan finishes (the FIFO is not opened for reading), and an enqueue of the
        # run goes through while adopt checks (the lock is held only while it writes)
        wait_until(lambda: "match: 100%" in "".join(err), 60, "adopt to finish its scan")
        enq = farm.cli("enqueue", str(data[0]), "--no-progress", timeout_s=15,
                       env={"FARM_OUTPUT_DIR": str(out), "FARM_MODEL_PATH": str(tiny_model)})
        assert enq.returncode == 0, enq.stdout + enq.stderr
        assert proc.poll() is None  # adopt still waits on the server
        server.kill(signal.SIGCONT)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        server.kill(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    # And the odd entries are refused by name, the rest adopted
    assert proc.returncode == 1, stdout + "".join(err)
    assert "adopted: 2 samples\n" in stdout and "refused: 2 files\n" in stdout, stdout
    assert (f"files: {N_COPIES + 4} read (adopted 2, already done 0, copies of another file "
            f"{N_COPIES}, refused 2)\n") in stdout, stdout
    assert re.search(r"^  samples/00/fifo.safetensors: not a regular file \(a FIFO\)", stdout,
                     re.M), stdout
    assert re.search(r"^  samples/00/outside.safetensors: a symbolic link to .*elsewhere.* "
                     r"outside SOURCE", stdout, re.M), stdout


def test_records_with_the_same_ids_each_get_the_file(
        data: tuple[Path, list[dict[str, Any]]], extracted: list[srcs.Extracted],
        chat: ChatTokenizer, tmp_path: Path, adopt_here: Callable[..., Result]) -> None:
    from worker.core.samples import validate_record

    # Given the example corpus's identical records (4 of record 0, 2 of record 1), and a
    # pre-tokenized record with record 5's ids and a mask of its own
    every = json.loads(EXAMPLES.read_text())
    twins = [every[i] for i in (0, 24, 144, 150, 1, 115, 5)]
    assert all(t["messages"] == every[0]["messages"] for t in twins[1:4])
    assert twins[5]["messages"] == every[1]["messages"]
    ids5 = extracted[5].ids
    pretok = {"id": "pretok-5", "input_ids": ids5, "loss_mask": [1] * len(ids5)}
    assert pretok["loss_mask"] != extracted[5].mask
    path = tmp_path / "twins.json"
    path.write_text(json.dumps([*twins, pretok]))
    src, out = tmp_path / "sf", tmp_path / "out"
    # and a source holding a file per sample, as a run over that corpus leaves it: twins'
    # files are copies of one another
    srcs.write_specforge(src, [extracted[0]] * 4 + [extracted[1]] * 2 + [extracted[5]])
    # When their files are adopted
    res = adopt_here(src, path, out)
    # Then each record has a final file of its own, with the states and its own loss mask,
    # and each count is of one thing and adds up: 7 files read, 3 adopted for 8 samples
    # (twin records share one), 4 copies of those; none refused
    assert res.returncode == 0, res.stdout + res.stderr
    assert "adopted: 8 samples\n" in res.stdout, res.stdout
    assert "refused: 0 files\n" in res.stdout, res.stdout
    assert ("files: 7 read (adopted 3, already done 0, copies of another file 4, refused 0)\n"
            in res.stdout), res.stdout
    refs = list(sample_refs(path, 1 << 20, [], []))
    assert len(refs) == 8
    by_ids = {tuple(e.ids): e for e in (extracted[0], extracted[1], extracted[5])}
    for ref, rec in zip(refs, [*twins, pretok], strict=True):
        tf = tensorfile.read(outdir.final_path(out, ref.key))
        e = by_ids[tuple(tf.tensors[T_INPUT_IDS].array.tolist())]
        assert np.array_equal(tf.tensors[T_AUX].array, srcs.bits(e.aux))
        want = chat.encode(validate_record(rec)).loss_mask
        assert tf.tensors[T_LOSS_MASK].array.tolist() == list(want), ref.key
        assert tf.metadata["content_sha256"] == ref.sha256
    # And again: a no-op that says so, and exit 0
    again = adopt_here(src, path, out)
    assert again.returncode == 0, again.stdout
    assert "adopted: 0 samples\n" in again.stdout and "already done: 8 samples\n" in again.stdout
    assert ("files: 7 read (adopted 0, already done 3, copies of another file 4, refused 0)\n"
            in again.stdout), again.stdout
    assert "nothing to adopt: this run already holds every sample" in again.stdout
