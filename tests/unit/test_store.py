"""The output store: manifest guard, durable writes, verification from disk, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine_dump.dumpfile import (
    DTYPE_FP8,
    DUMP_SUFFIX,
    T_AUX,
    T_HIDDEN,
    T_INPUT_IDS,
    T_LOSS_MASK,
    TMP_MARK,
    is_temp_name,
    rid_of_file,
)
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from engine_dump.rids import is_user_sample_key, make_rid, parse_rid
from worker.core import tensorfile
from worker.core.errors import ConfigError, Corrupt
from worker.core.finalfile import M_CONTENT
from worker.core.store import OutputStore, Part

H = 4


def _fp(**kw: object) -> Fingerprint:
    base: dict[str, object] = dict(
        config_sha256="a", tokenizer_sha256="b", chat_template_sha256="c",
        layers_to_capture=(2, 4, 5), layer_convention=LAYER_CONVENTION, hidden_size=H,
        dtype="bfloat16", max_tokens=8192, overlong="reject")
    base.update(kw)
    return Fingerprint(**base)  # type: ignore[arg-type]


def _arrays(n: int = 5) -> dict[str, tuple[str, np.ndarray]]:
    rng = np.random.default_rng(n)
    return {
        T_INPUT_IDS: ("I64", np.arange(n, dtype=np.int64)),
        T_LOSS_MASK: ("I64", np.ones(n, dtype=np.int64)),
        T_HIDDEN: ("BF16", rng.integers(0, 0x3F00, (n, H), dtype=np.uint16)),
        T_AUX: ("BF16", rng.integers(0, 0x3F00, (n, 3 * H), dtype=np.uint16)),
    }


def _tensors(n: int = 5) -> dict[str, Part]:
    return {k: Part.from_array(dt, a) for k, (dt, a) in _arrays(n).items()}


def test_write_then_verify_from_disk(tmp_path: Path) -> None:
    store = OutputStore(tmp_path, _fp()).open()
    path = store.write("k1", _tensors(), {M_CONTENT: "h1"})
    v = store.verify("k1", "h1")
    assert v.tokens == 5 and v.size_bytes == path.stat().st_size
    head = tensorfile.read_header(path)  # what enqueue reads: the header, no tensor data
    assert head.metadata[M_CONTENT] == "h1" and head.shapes[T_HIDDEN] == (5, H)
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert not [p for p in tmp_path.rglob("*") if is_temp_name(p.name)]
    # the file is a plain safetensors file that torch loads with the right dtypes
    import torch
    from safetensors.torch import load_file

    t = load_file(str(path))
    assert t[T_HIDDEN].dtype == torch.bfloat16 and t[T_HIDDEN].shape == (5, H)


def test_one_flipped_byte_is_caught(tmp_path: Path) -> None:
    store = OutputStore(tmp_path, _fp()).open()
    path = store.write("k1", _tensors(), {M_CONTENT: "h1"})
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(Corrupt, match=r"checksum of (aux_)?hidden_state"):
        store.verify("k1", "h1")


def test_truncated_file_is_caught(tmp_path: Path) -> None:
    store = OutputStore(tmp_path, _fp()).open()
    path = store.write("k1", _tensors(), {M_CONTENT: "h1"})
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(Corrupt, match="not a valid safetensors"):
        store.verify("k1", "h1")
    with pytest.raises(Corrupt):  # the header survives; the data does not
        store.verify("k1")


def test_wrong_shapes_are_caught(tmp_path: Path) -> None:
    store = OutputStore(tmp_path, _fp(hidden_size=H + 1)).open()
    with pytest.raises(Corrupt, match="hidden_state shape"):
        store.write("k1", _tensors(), {M_CONTENT: "h1"})
    with pytest.raises(FileNotFoundError):  # refused before a byte was written
        store.verify("k1", "h1")
    assert not [p for p in tmp_path.rglob("*") if is_temp_name(p.name)]


def test_states_of_another_dtype_never_reach_a_final_path(tmp_path: Path) -> None:
    # Given an fp8 run, and a writer that hands it bf16 states
    store = OutputStore(tmp_path, _fp(dtype=DTYPE_FP8)).open()
    # When it writes, Then nothing is written, and the refusal names the dtypes
    with pytest.raises(Corrupt, match=r"hidden_state dtype BF16 \(this run stores F8_E4M3\)"):
        store.write("k1", _tensors(), {M_CONTENT: "h1"})
    assert not [p for p in tmp_path.rglob("*.safetensors*")]


def test_a_file_that_does_not_read_back_whole_never_takes_its_final_path(
        tmp_path: Path) -> None:
    # Given a write whose bytes change on the device after they were checksummed
    store = OutputStore(tmp_path, _fp()).open()
    shard = store.final_path("x").parent

    def flip() -> None:
        [tmp] = shard.glob(f".x.safetensors{TMP_MARK}*")
        with open(tmp, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            b = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([b[0] ^ 1]))

    # When it is written, Then the read-back refuses it before the rename: no file is left
    with pytest.raises(Corrupt, match=r"checksum of (aux_)?hidden_state"):
        store.write("x", _tensors(), {M_CONTENT: "h"}, validate=flip)
    assert not list(shard.iterdir())


def test_output_dir_of_another_run_is_refused(tmp_path: Path) -> None:
    OutputStore(tmp_path, _fp()).open()
    OutputStore(tmp_path, _fp()).open()  # same run: fine
    with pytest.raises(ConfigError, match=r"layers_to_capture: \[2, 4, 6\] != \[2, 4, 5\]"):
        OutputStore(tmp_path, _fp(layers_to_capture=(2, 4, 6))).open()


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    # Given a temp file from a writer that died, one from a live writer and a finished file
    store = OutputStore(tmp_path, _fp()).open()
    store.write("done", _tensors(), {M_CONTENT: "h"})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from worker.core import liveness

    shard = store.final_path("x").parent
    shard.mkdir(parents=True, exist_ok=True)
    stale = shard / f".x.safetensors{TMP_MARK}{liveness.temp_tag('abcd1234', dead.pid)}"
    live = shard / f".y.safetensors{TMP_MARK}{liveness.temp_tag('abcd1234')}"
    # and, with the same dead pid: one of another machine (boot or pid namespace) of our
    # hostname, and one of an older version, whose name does not say where it was written
    elsewhere = shard / (f".z.safetensors{TMP_MARK}{liveness.HOST}.m0123456789abcdef-1."
                         f"{dead.pid}.abcd1234")
    older = shard / f".w.safetensors{TMP_MARK}{liveness.HOST}.{dead.pid}.abcd1234"
    for p in (stale, live, elsewhere, older):
        p.write_bytes(b"partial")
    # When cleaning at start-up
    assert store.clean_stale_temp(max_age_s=3600) == 1
    # Then only the dead writer's temp file of this machine is gone; the others wait for
    # their age
    assert not stale.exists() and live.exists() and elsewhere.exists() and older.exists()
    assert store.clean_stale_temp(max_age_s=0) == 3
    store.verify("done", "h")


def test_a_write_removes_the_sample_s_temp_files_of_writers_without_its_lease(
        tmp_path: Path) -> None:
    # Given temp files of sample x left by a writer of another pid namespace or host and by a
    # live process of this machine (both lost x's lease: the write below holds it), and one
    # of sample y
    from worker.core import liveness

    store = OutputStore(tmp_path, _fp()).open()
    shard = store.final_path("x").parent
    elsewhere = shard / (f".x.safetensors{TMP_MARK}{liveness.HOST}.m0123456789abcdef-1."
                         "4242.abcd1234")
    live = shard / f".x.safetensors{TMP_MARK}{liveness.temp_tag('abcd1234')}"
    other = store.final_path("y").with_name(f".y.safetensors{TMP_MARK}"
                                            f"{liveness.temp_tag('abcd1234')}")
    for p in (elsewhere, live, other):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"partial")
    # When x is written
    store.write("x", _tensors(), {M_CONTENT: "h"})
    # Then x's temp files are gone, y's is not, and x's file is whole
    assert not elsewhere.exists() and not live.exists() and other.exists()
    store.verify("x", "h")


def test_a_write_whose_temp_file_was_removed_writes_nothing_and_says_the_lease_is_lost(
        tmp_path: Path) -> None:
    from worker.core.errors import LeaseLost

    # Given a write whose temp file another attempt removes before its rename (it took the
    # sample's lease: this writer stopped renewing)
    store = OutputStore(tmp_path, _fp()).open()
    shard = store.final_path("x").parent

    def taken() -> None:
        for p in shard.glob(f".x.safetensors{TMP_MARK}*"):
            p.unlink()

    # When it renames, Then it raises LeaseLost (the task hands the message back, no attempt
    # spent) and leaves no file
    with pytest.raises(LeaseLost, match="another attempt of x holds its lease now"):
        store.write("x", _tensors(), {M_CONTENT: "h"}, validate=taken)
    assert not list(shard.iterdir())


def _legacy_file(store: OutputStore, key: str, content: str) -> Path:
    """A final file as the worker wrote it before issue 9: serialize_file, sha256 under
    ``sha256``, no ``checksum_algorithm``."""
    import hashlib
    import json

    from safetensors import TensorSpec, serialize_file

    arrays = {k: np.ascontiguousarray(a) for k, (_, a) in _arrays().items()}
    sums = {k: hashlib.sha256(a.data).hexdigest() for k, a in arrays.items()}
    meta = {M_CONTENT: content, "sample_key": key, "fingerprint_id": store.fingerprint.id,
            "sha256": json.dumps(sums, sort_keys=True)}
    specs = {k: TensorSpec(dtype="int64" if a.dtype == np.int64 else "bfloat16",
                           shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
             for k, a in arrays.items()}
    path = store.final_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    serialize_file(specs, str(path), metadata=meta)
    return path


def test_files_of_the_previous_format_still_verify(tmp_path: Path) -> None:
    # Given an output dir holding a file written by the worker before the upgrade
    store = OutputStore(tmp_path, _fp()).open()
    path = _legacy_file(store, "old", "h1")
    # Then it verifies and reads the same (sha256 recomputed from the disk)
    v = store.verify("old", "h1")
    assert v.tokens == 5 and list(v.file.tensors[T_INPUT_IDS].array) == list(range(5))
    # And a flipped byte in it is still caught
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(Corrupt, match="checksum of hidden_state"):
        store.verify("old", "h1")


def test_final_files_read_the_same_in_the_safetensors_library(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open

    store = OutputStore(tmp_path, _fp()).open()
    path = store.write("k1", _tensors(), {M_CONTENT: "h1"})
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["checksum_algorithm"] == "xxh3-128" and meta[M_CONTENT] == "h1"
        for name, (dtype, arr) in _arrays().items():
            t = f.get_tensor(name)
            assert t.dtype == (torch.int64 if dtype == "I64" else torch.bfloat16)
            assert t.contiguous().view(torch.uint8).numpy().tobytes() == arr.tobytes()


@pytest.mark.parametrize("tensor", [T_INPUT_IDS, T_LOSS_MASK, T_HIDDEN, T_AUX])
def test_a_flipped_byte_in_any_tensor_is_caught(tmp_path: Path, tensor: str) -> None:
    store = OutputStore(tmp_path, _fp()).open()
    path = store.write("k1", _tensors(), {M_CONTENT: "h1"})
    with open(path, "rb") as f:
        header = tensorfile.read_header_fd(f.fileno(), path.name)
    offset = header.data_start + header.tensors[tensor].begin + 1
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(Corrupt, match=f"checksum of {tensor}$"):
        store.verify("k1", "h1")
    assert len(os.listdir("/proc/self/fd")) == before


def test_unknown_checksum_algorithm_is_corrupt(tmp_path: Path) -> None:
    store = OutputStore(tmp_path, _fp()).open()
    path = store.write("k1", _tensors(), {M_CONTENT: "h1"})
    data = path.read_bytes().replace(b'"xxh3-128"', b'"xxh9-128"')
    path.write_bytes(data)
    with pytest.raises(Corrupt, match="unknown checksum algorithm"):
        store.verify("k1", "h1")


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache now: mincore(2) on a fresh mapping of it (mapping
    reads nothing; the mapping is ours, libc's mmap, so no Python buffer is involved)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        try:
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    return sum(b & 1 for b in vec)


def test_written_files_leave_the_page_cache_so_verify_reads_the_disk(tmp_path: Path) -> None:
    # Given a final file of several MB just written
    store = OutputStore(tmp_path, _fp(hidden_size=4096)).open()
    n = 300
    rng = np.random.default_rng(0)
    parts = {T_INPUT_IDS: Part.from_array("I64", np.arange(n)),
             T_LOSS_MASK: Part.from_array("I64", np.ones(n)),
             T_HIDDEN: Part.from_array("BF16", rng.integers(0, 0x3F00, (n, 4096))),
             T_AUX: Part.from_array("BF16", rng.integers(0, 0x3F00, (n, 3 * 4096)))}
    path = store.write("big", parts, {M_CONTENT: "h"})
    # Then none of its pages are cached: the read-back can only come from the device
    assert path.stat().st_size > 9 << 20
    assert _resident_pages(path) == 0
    # (the probe itself sees pages that are cached)
    path.read_bytes()
    assert _resident_pages(path) > 0
    store.verify("big", "h")


@pytest.mark.parametrize("source", ["memory", "mapped"])
def test_enospc_is_no_space_whichever_call_hits_it(tmp_path: Path, source: str) -> None:
    from tests.support.faults import can_mount_tmpfs, small_tmpfs
    from worker.core.errors import NoSpace

    if not can_mount_tmpfs(tmp_path):
        pytest.skip("needs root to mount a small tmpfs")
    # Given an output dir on a real 1 MB tmpfs, and a 3 MB tensor from memory or from a file
    big = np.random.default_rng(0).integers(0, 0x3F00, (128, 3 * 4096), dtype=np.uint16)
    src = tmp_path / "dump.bin"
    src.write_bytes(big.tobytes())
    with small_tmpfs(tmp_path / "out", "1M") as out, open(src, "rb", buffering=0) as f:
        store = OutputStore(out, _fp(hidden_size=4096)).open()
        aux = (Part.from_array("BF16", big) if source == "memory" else
               Part("BF16", big.shape, source=f, offset=0))
        parts = {**_tensors(128), T_HIDDEN: Part.from_array("BF16", big[:, :4096]),
                 T_AUX: aux}
        # When the write runs out of space
        with pytest.raises(NoSpace, match="No space left"):
            store.write("k", parts, {M_CONTENT: "h"})
        # Then nothing partial is left behind, and the source is no longer mapped
        assert [p for p in out.rglob("*") if p.is_file()] == [out / "manifest.json"]
        assert str(src) not in Path("/proc/self/maps").read_text()


def test_parts_from_a_file_are_checked_and_checksummed_as_copied(tmp_path: Path) -> None:
    from worker.core import checksums

    # Given a tensor copied from a file, at an offset, with a check seeing every piece
    store = OutputStore(tmp_path / "out", _fp()).open()
    arr = _arrays()[T_AUX][1]
    src = tmp_path / "src"
    src.write_bytes(b"pad" + arr.tobytes())
    seen = bytearray()
    with open(src, "rb", buffering=0) as f:
        aux = Part("BF16", arr.shape, source=f, offset=3, check=seen.extend)
        parts = {**_tensors(), T_AUX: aux}
        path = store.write("k", parts, {M_CONTENT: "h"})
        # Then the check saw exactly the bytes, the header written last holds their digest,
        # and the file verifies
        assert bytes(seen) == arr.tobytes()
        assert checksums.file_checksums(tensorfile.header_metadata(path))[1][T_AUX] == (
            checksums.tensor_checksum(arr.tobytes()))
        store.verify("k", "h")
        # And a validation that fails after the copy leaves nothing behind, and says why
        def bad() -> None:
            raise Corrupt("dump x: aux_hidden_state has 1 NaN/Inf values")

        with pytest.raises(Corrupt, match="NaN"):
            store.write("k2", parts, {M_CONTENT: "h"}, validate=bad)
    files = sorted(p.name for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert files == ["k.safetensors", "manifest.json"]


def test_a_key_holding_the_temp_mark_is_a_final_file_never_a_temp_file(tmp_path: Path) -> None:
    # Given finished samples whose keys hold the temp mark (valid record ids), aged past any
    # temp file's age limit, and a dead writer's real temp file of one of them
    from worker.core import liveness
    from worker.state import hosts

    store = OutputStore(tmp_path, _fp()).open()
    keys = ["a.tmp.b", "x.tmp.1234", "rec.tmp.host.m1.99.abcd", "plain"]
    for key in keys:
        assert is_user_sample_key(key)
        path = store.write(key, _tensors(), {M_CONTENT: "h"})
        os.utime(path, (1, 1))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    final = store.final_path("a.tmp.b")
    stale = final.with_name(f".{final.name}{TMP_MARK}{liveness.temp_tag('abcd1234', dead.pid)}")
    stale.write_bytes(b"partial")
    # When a worker starts (stale temp cleanup with any age limit)
    store.clean_stale_temp(max_age_s=0)
    # Then every final file is kept and verifies, the dead writer's temp file is gone, and
    # the run's file walks (hosts, adopt, training) see all of them
    assert not stale.exists()
    for key in keys:
        store.verify(key, "h")
    assert sorted(p.name for p in hosts._final_files(tmp_path)) == sorted(
        f"{k}{DUMP_SUFFIX}" for k in keys)
    assert not any(is_temp_name(f"{k}{DUMP_SUFFIX}") for k in keys)
    assert rid_of_file(f".{make_rid('a.tmp.b', 1, 5)}{TMP_MARK}4242") == parse_rid(
        make_rid("a.tmp.b", 1, 5))
