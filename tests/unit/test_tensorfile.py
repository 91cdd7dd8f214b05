"""The safetensors header parser/builder, held against the safetensors library itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from worker.core import tensorfile
from worker.core.errors import Corrupt


def _write(path: Path, arrays: dict[str, tuple[str, np.ndarray]], meta: dict[str, str]) -> None:
    head, header = tensorfile.encode_header({k: (d, a.shape) for k, (d, a) in arrays.items()},
                                            meta)
    with open(path, "wb") as f:
        f.write(head)
        for name, _, _ in header.file_ranges():
            f.write(np.ascontiguousarray(arrays[name][1]).tobytes())


def test_our_files_read_the_same_in_the_safetensors_library(tmp_path: Path) -> None:
    # Given tensors of every dtype we write, in an order unlike the layout order
    rng = np.random.default_rng(0)
    arrays: dict[str, tuple[str, np.ndarray]] = {
        "z_bf16": ("BF16", rng.integers(0, 1 << 16, (3, 5), dtype=np.uint16)),
        "a_i64": ("I64", np.arange(7, dtype=np.int64)),
        "m_u8": ("U8", np.arange(3, dtype=np.uint8)),
        "empty": ("I64", np.zeros(0, dtype=np.int64))}
    path = tmp_path / "x.safetensors"
    # When we write a file with our header
    _write(path, arrays, {"k": "v", "json": json.dumps({"a": 1})})
    # Then the library parses it with the same names, dtypes, shapes, metadata and bytes
    import torch

    dtypes = {"BF16": torch.bfloat16, "I64": torch.int64, "U8": torch.uint8}
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v", "json": '{"a": 1}'}
        assert set(f.keys()) == set(arrays)
        for name, (dtype, arr) in arrays.items():
            got = f.get_tensor(name)
            assert got.dtype == dtypes[dtype] and tuple(got.shape) == arr.shape
            assert got.contiguous().view(torch.uint8).numpy().tobytes() == arr.tobytes()
    # And our reader agrees, and the header is 8-byte aligned as the library writes it
    tf = tensorfile.read(path)
    assert {k: t.dtype for k, t in tf.tensors.items()} == {k: d for k, (d, _) in arrays.items()}
    assert np.array_equal(tf.tensors["z_bf16"].array, arrays["z_bf16"][1])
    assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0


def test_truncated_extended_and_malformed_files_are_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    _write(path, {"a": ("I64", np.arange(4, dtype=np.int64))}, {})
    good = path.read_bytes()
    n = int.from_bytes(good[:8], "little")
    bad_json = good[:8] + b"{" + b" " * (n - 1) + good[8 + n:]
    gap = good[:8] + good[8 : 8 + n].replace(b"[0,32]", b"[8,40]") + good[8 + n:] + b"\0" * 8
    cases = {"truncated": good[:-1], "extended": good + b"\0", "header past the end": good[:20],
             "empty": b"", "not JSON": bad_json, "gap before a tensor": gap}
    for what, raw in cases.items():
        path.write_bytes(raw)
        with pytest.raises(Corrupt, match="not a valid safetensors file"):
            tensorfile.read(path)
        print("rejected:", what)


def test_unknown_dtype_and_size_mismatch_are_corrupt() -> None:
    for entry in ({"dtype": "F64", "shape": [1], "data_offsets": [0, 8]},
                  {"dtype": "I64", "shape": [2], "data_offsets": [0, 8]}):
        raw = json.dumps({"t": entry}).encode()
        with pytest.raises(Corrupt):
            tensorfile.parse_header(raw, 8 + len(raw) + 8, "x")


def test_fast_nonfinite_test_agrees_with_the_count_on_every_bf16_value() -> None:
    # Given every one of the 65,536 bf16 bit patterns, each alone among finite values
    finite = np.full(1000, 0x3F80, dtype=np.uint16)  # 1.0
    for v in range(1 << 16):
        chunk = finite.copy()
        chunk[v % 1000] = v
        # Then the fast test says "some" exactly when the exact count is non-zero
        assert tensorfile.bf16_any_nonfinite(chunk) == bool(
            tensorfile.bf16_nonfinite(chunk)), hex(v)
    assert tensorfile.bf16_nonfinite(np.array([0x7F80, 0xFF80, 0x7FC0, 0x7F7F, 0xFF7F],
                                              dtype=np.uint16)) == 3
