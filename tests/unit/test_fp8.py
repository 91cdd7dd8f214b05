"""fp8 storage (FARM_STORE_DTYPE=fp8_e4m3) in one process: the codecs' error bounds and their
agreement, the hook's dumps, the synthetic stager, the worker's store and its refusals, files
of the older layout, verify, and the storage dtype in the run's fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_dump import fp8 as codec
from engine_dump.dump_writer import DumpCollector, DumpWriter
from engine_dump.dumpfile import (
    DTYPE_BF16,
    DTYPE_FP8,
    ENV_DUMP_DTYPE,
    FP8_BLOCK,
    M_CONFIG_SHA,
    M_DUMP_DTYPE,
    M_LAYERS,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    T_INPUT_IDS,
    T_LOSS_MASK,
    dump_path,
    fp8_blocks,
    hidden_layout,
)
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from engine_dump.rids import make_rid
from tests.support.fp8 import rel_err
from worker.core import checksums, dumps, outdir, tensorfile
from worker.core import fp8 as checks
from worker.core.errors import ConfigError, Corrupt, ServerMisconfigured
from worker.core.finalfile import M_CONTENT
from worker.core.settings import Settings
from worker.core.store import OutputStore, Part

H = 256
LAYERS = (2, 4, 5)
RUN = "0123456789abcdef"


def _fp(dtype: str = DTYPE_FP8, h: int = H) -> Fingerprint:
    return Fingerprint("cfg", "tok", "tpl", LAYERS, LAYER_CONVENTION, h, dtype, 8192,
                       "reject")


def _states(n: int, seed: int = 0) -> torch.Tensor:
    """Rows like a model's: Gaussian with a few large outlier channels, one row of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4 * H, generator=g) * 2
    x[:, ::97] *= 40  # massive activations in a few channels
    x[3] = 0
    return x


def test_round_trip_error_is_within_e4m3s_bounds_and_the_codecs_agree() -> None:
    # Given model-like rows (outlier channels, a row of zeros)
    x = _states(64)
    # When quantized with a scale per block of 128 values of each row and dequantized
    q, s = codec.quantize(x, 4)
    assert s.shape == (64, 4 * H // FP8_BLOCK)
    back = codec.dequantize(q, s, torch.float32, layers=4)
    # Then every value is within half a step of e4m3 (3 mantissa bits: 2^-4 relative, and
    # the subnormal step below 2^-6), every scale is finite and > 0, zeros stay zeros
    per_value = s.repeat_interleave(FP8_BLOCK, dim=1)
    step = x.abs() * 2.0 ** -4 + per_value * 2.0 ** -10
    assert ((back - x).abs() <= step).all()
    assert checks.bad_scales(s.numpy()) == 0 and not back[3].any()
    err = rel_err(x, back, 4)
    assert err.max() < 0.05 and err.mean() < 0.03, (err.max(), err.mean())
    # And the worker's table (numpy, no torch) reads the same values as torch
    assert np.array_equal(checks.dequantize(q.numpy(), s.numpy(), layers=4), back.numpy())
    # And a chunked prefill quantizes the same bytes as one pass (scales are per token)
    q1, s1 = codec.quantize(x[:7], 4)
    q2, s2 = codec.quantize(x[7:], 4)
    assert torch.equal(torch.cat([q1, q2]), q) and torch.equal(torch.cat([s1, s2]), s)


@pytest.mark.parametrize("h", [256, 200, 64])
@pytest.mark.parametrize("per_row", [False, True], ids=["blocks", "per-row"])
def test_the_torch_and_numpy_codecs_agree_bit_for_bit_in_both_layouts(h: int,
                                                                        per_row: bool) -> None:
    # Given rows of 3 layers of h values (200: a last block of 72), quantized in blocks of 128
    # or with one scale per token per layer (the layout of files written before the blocks)
    g = torch.Generator().manual_seed(h)
    x = torch.randn(9, 3 * h, generator=g) * torch.logspace(-3, 3, 3 * h)
    q, s = codec.quantize(x, 3, block=h if per_row else FP8_BLOCK)
    assert s.shape == (9, 3 * (1 if per_row else fp8_blocks(h)))
    # Then numpy's float32 values are torch's, bit for bit, and so are the bf16 roundings
    back = codec.dequantize(q, s, torch.float32, layers=3)
    np_back = checks.dequantize(q.numpy(), s.numpy(), layers=3)
    assert np_back.dtype == np.float32
    assert np.array_equal(np_back.view(np.uint32), back.numpy().view(np.uint32))
    assert torch.equal(codec.dequantize(q, s, layers=3), back.to(torch.bfloat16))
    # And each value is read with its own block's scale: within half an e4m3 step
    per_value = s.view(9, 3, -1).repeat_interleave(h if per_row else FP8_BLOCK, dim=2)
    per_value = per_value[:, :, :h].reshape(9, 3 * h)
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + per_value * 2.0 ** -10).all()
    # And a scale tensor of neither layout is refused, not misread
    with pytest.raises(ValueError, match="7 fp8 scales per token per layer"):
        checks.dequantize(q.numpy(), np.ones((9, 3 * 7), np.float32), layers=3)


def _massive_row(magnitude: float, seed: int = 0, h: int = 7168) -> torch.Tensor:
    """Gaussian rows of ``h`` values (bf16-rounded, as states are) whose channel 1234 is
    ``magnitude`` (the rest ~N(0, 1)): a residual stream's massive activation."""
    x = torch.randn(8, h, generator=torch.Generator().manual_seed(seed))
    x[:, 1234] = magnitude
    return x.to(torch.bfloat16).float()


def test_a_massive_channel_no_longer_flushes_its_rows_small_values_to_zero() -> None:
    # Given rows with one channel 10^4 above the rest (H = 7168)
    x = _massive_row(1e4)
    nonzero = x != 0
    block_of_massive = slice(1234 // 128 * 128, 1234 // 128 * 128 + 128)
    flushed = {}
    for name, block in (("per-row", 7168), ("blocks", FP8_BLOCK)):
        q, s = codec.quantize(x, 1, block=block)
        back = codec.dequantize(q, s, torch.float32, layers=1)
        flushed[name] = (back == 0) & nonzero
        rel = ((back - x).abs() / x.abs())[nonzero]
        flushed[name + " p99"] = float(rel.quantile(0.99))
    # Then one scale per row flushed ~130 of each row's 7,167 other values to zero (p99 100%)
    assert flushed["per-row"].sum(1).min() > 100 and flushed["per-row p99"] == 1.0
    # And blocks of 128 flush none outside the massive channel's own block, and a few of the
    # 127 inside it (e4m3 spans 2^17.8 with subnormals: |x| < 2^-10 * 10^4 / 448 = 0.022 of a
    # N(0, 1) value is 1.7%); the p99 error is e4m3's rounding, as on a Gaussian row
    outside = flushed["blocks"].clone()
    outside[:, block_of_massive] = False
    assert not outside.any()
    assert flushed["blocks"].sum(1).max() <= 6, flushed["blocks"].sum(1)
    assert flushed["blocks p99"] < 0.06


def test_nan_and_inf_reach_the_worker_as_nan_bytes_or_bad_scales() -> None:
    x = _states(4)
    x[0, 5], x[1, H + 7] = float("nan"), float("inf")
    q, s = codec.quantize(x, 4)
    assert checks.nan_count(q.numpy()) >= 2
    assert checks.bad_scales(s.numpy()) == 2  # row 0's layer 0 (NaN), row 1's layer 1 (Inf)
    nb = fp8_blocks(H)
    assert not s[0, 0].isfinite() and not s[1, nb + 7 // FP8_BLOCK].isfinite()


def test_the_hook_dumps_fp8_and_the_farms_own_requests_bf16(tmp_path: Path) -> None:
    # Given an fp8 hook, a sample's request and a canary's, in two chunks
    writer = DumpWriter(tmp_path / "d", {}, dtype=DTYPE_FP8)
    col = DumpCollector(writer)
    n = 10
    sample, canary = (make_rid(k, 1, n, run=RUN) for k in ("k1", "_hsfarm_canary0_m_1_x"))
    x = _states(2 * n)
    ids = torch.arange(2 * n)
    # (rows of the two requests interleave per pass: [sample 0..5, canary 0..5], then 6..9)
    first = torch.cat([x[:6], x[n:n + 6]])
    second = torch.cat([x[6:n], x[n + 6:]])
    for prefix, ext, rows in ((0, 6, first), (6, 4, second)):
        col.on_forward([sample, canary], [prefix] * 2, [ext] * 2, ids, rows[:, :H], rows[:, H:])
    writer.flush()
    writer.close()
    # Then the sample's dump is fp8 with its scales, equal to quantizing it in one pass
    got = load_file(str(dump_path(tmp_path / "d", sample)))
    hq, hs = codec.quantize(x[:n, :H], 1)
    aq, as_ = codec.quantize(x[:n, H:], 3)
    assert got[T_HIDDEN].dtype == torch.float8_e4m3fn
    assert torch.equal(got[T_HIDDEN].view(torch.uint8), hq)
    assert torch.equal(got[T_AUX].view(torch.uint8), aq)
    assert torch.equal(got[T_HIDDEN_SCALE], hs) and torch.equal(got[T_AUX_SCALE], as_)
    assert tensorfile.header_metadata(dump_path(tmp_path / "d", sample))[
        M_DUMP_DTYPE] == DTYPE_FP8
    # And the canary's dump is bf16, as in a bf16 run (the canary compares unquantized states)
    got = load_file(str(dump_path(tmp_path / "d", canary)))
    assert set(got) == {T_INPUT_IDS, T_HIDDEN, T_AUX}
    assert torch.equal(got[T_HIDDEN], x[n:, :H].to(torch.bfloat16))


def test_the_synthetic_servers_stager_quantizes_without_holding_the_pool() -> None:
    # Given the synthetic model's pooled forward pass and its stager (no copy in bf16)
    from engine_dump.dump_writer import encode_fp8
    from sglang_patch.synthetic import PooledStager, SyntheticModel, ensure_synthetic_model
    from tests.conftest import CACHE

    m = SyntheticModel(ensure_synthetic_model(CACHE, H, 61))
    out = m.forward_batch([([1, 2, 3, 4], 0)])
    want = encode_fp8([out.ids[:4], out.hidden[:4], out.aux[:4]])
    # When a part is staged with the fp8 encoder
    staged = PooledStager(m.pool).stage([out.ids[:4], out.hidden[:4], out.aux[:4]], encode_fp8)
    # Then it holds the quantized rows, and no lease on the hidden-state buffers
    got = staged.wait()
    assert len(got) == 5 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(m.pool.lease_of(t) is None for t in got[1:])


def _fp8_dump(path: Path, ids: list[int], x: torch.Tensor, dtype: str = DTYPE_FP8,
              nan: tuple[int, int] | None = None, scale: tuple[int, int] | None = None,
              block: int = FP8_BLOCK) -> Path:
    """A dump as the fp8 hook writes it; ``nan`` (row, col) of aux gets the NaN byte,
    ``scale`` (row, column) of aux's scales becomes 0; ``block`` = H: one scale per token per
    layer, as the hook wrote before the blocks."""
    hq, hs = codec.quantize(x[:, :H], 1, block=block)
    aq, as_ = codec.quantize(x[:, H:], 3, block=block)
    if nan is not None:
        aq[nan] = 0x7F
    if scale is not None:
        as_[scale] = 0.0
    meta = {M_LAYERS: json.dumps(list(LAYERS)), M_CONFIG_SHA: "cfg", M_DUMP_DTYPE: dtype}
    save_file({T_INPUT_IDS: torch.tensor(ids), T_HIDDEN: hq.view(codec.FP8),
               T_HIDDEN_SCALE: hs, T_AUX: aq.view(codec.FP8), T_AUX_SCALE: as_},
              str(path), metadata=meta)
    return path


def _copy(store: OutputStore, d: dumps.Dump, key: str = "k") -> Path:
    parts = {name: d.part(name) for name in (T_INPUT_IDS, *hidden_layout(DTYPE_FP8, 0, 0))}
    parts[T_LOSS_MASK] = Part.from_array("I64", np.ones(len(d.ids) // 8, dtype=np.int64))
    return store.write(key, parts, {M_CONTENT: "h"}, validate=d.verdict)


def test_the_worker_stores_fp8_dumps_and_refuses_nan_zero_scales_and_the_other_dtype(
        tmp_path: Path) -> None:
    n = 40
    ids = list(range(n))
    x = _states(n)
    store = OutputStore(tmp_path / "out", _fp()).open()
    # A good fp8 dump is copied byte for byte, with checksums over the stored bytes
    with dumps.open_dump(_fp8_dump(tmp_path / "good", ids, x), ids, _fp()) as d:
        final = _copy(store, d)
    v = store.verify("k", "h")
    assert v.tokens == n
    stored = tensorfile.read(final).tensors
    assert stored[T_AUX].dtype == "F8_E4M3"
    sums = checksums.file_checksums(tensorfile.header_metadata(final))[1]
    assert sums[T_AUX_SCALE] == checksums.tensor_checksum(stored[T_AUX_SCALE].array.data)
    # A NaN byte or a zero scale from the server: refused, with counts, nothing written
    for nan, scale, message in (((5, 9), None, "aux_hidden_state has 1 NaN/Inf values"),
                                (None, (7, 2), "aux_hidden_state_scale has 1 scales")):
        path = _fp8_dump(tmp_path / "bad", ids, x, nan=nan, scale=scale)
        with dumps.open_dump(path, ids, _fp()) as d, pytest.raises(Corrupt, match=message):
            _copy(store, d, "bad")
        assert not outdir.final_path(store.out_dir, "bad").exists()
    # A dump of the other dtype is the server's misconfiguration (the worker waits), with the fix
    with pytest.raises(ServerMisconfigured, match=f"{ENV_DUMP_DTYPE}=fp8_e4m3"):
        dumps.open_dump(_fp8_dump(tmp_path / "bf", ids, x, dtype=DTYPE_BF16), ids, _fp())
    with pytest.raises(ServerMisconfigured, match="holds fp8_e4m3 hidden states, this run "
                                                  "stores bfloat16"):
        dumps.open_dump(tmp_path / "good", ids, _fp(DTYPE_BF16))


def test_files_of_one_scale_per_row_are_still_read_by_every_reader(tmp_path: Path) -> None:
    from training.export.formats import FORMATS
    from training.export.runner import export
    from training.loader import HiddenStates

    # Given an fp8 run's dir holding a file of the block layout and one of the per-row layout
    # (written before the blocks, by a hook of a run in flight), each stored from a real dump
    n = 12
    ids = list(range(n))
    x = _states(n)
    x[:, 5] = 3e4  # a massive channel: the two layouts differ
    store = OutputStore(tmp_path / "out", _fp()).open()
    for key, block in (("blocks", FP8_BLOCK), ("rows", H)):
        with dumps.open_dump(_fp8_dump(tmp_path / key, ids, x, block=block), ids, _fp()) as d:
            _copy(store, d, key)
    shapes = {k: tensorfile.read_header(store.final_path(k)).tensors[T_AUX_SCALE].shape
              for k in ("blocks", "rows")}
    assert shapes == {"blocks": (n, 3 * H // FP8_BLOCK), "rows": (n, 3)}
    # Then the worker's read-back (and audit's) verifies both
    for key in shapes:
        store.verify(key, "h")
    # And the loader hands out each file's own dequantization, in bf16
    ds = HiddenStates(store.out_dir, verify=True)
    got = {k: ds[i] for i, k in enumerate(ds.keys)}
    for key, block in (("blocks", FP8_BLOCK), ("rows", H)):
        aq, as_ = codec.quantize(x[:, H:], 3, block=block)
        want = codec.dequantize(aq, as_, layers=3)
        assert torch.equal(got[key][T_AUX], want)
    flushed = {k: int(((got[k][T_HIDDEN] == 0) & (x[:, :H] != 0)).sum()) for k in got}
    assert flushed["blocks"] < flushed["rows"], flushed  # the massive channel's layer
    # And an export writes both as bf16 and verifies them
    summary = export(store.out_dir, "specforge", tmp_path / "sf")
    assert summary.ok and summary.exported == 2, summary.lines()
    for key in shapes:
        back = FORMATS["specforge"].read_back(tmp_path / "sf" / FORMATS["specforge"].rel_path(key))
        assert np.array_equal(back[T_AUX].reshape(n, 3 * H),
                              got[key][T_AUX].view(torch.int16).numpy().view(np.uint16))
    # And a scale tensor of neither layout is corrupt for the worker's dump check
    bad = _fp8_dump(tmp_path / "odd", ids, x, block=64)
    with pytest.raises(Corrupt, match=r"hidden_state_scale is F32\[12, 4\], expected F32\[12, 2\]"):
        dumps.open_dump(bad, ids, _fp())


def test_a_server_of_the_other_dtype_is_named_before_the_worker_takes_work(
        tmp_path: Path) -> None:
    from engine_dump.markers import write_ready_marker

    # Given a dump dir whose live hook (this process) stores fp8, and one of an older hook
    fp8_dir, old_dir = tmp_path / "fp8", tmp_path / "old"
    for d in (fp8_dir, old_dir):
        d.mkdir(mode=0o700)
    write_ready_marker(fp8_dir, {"dump_dtype": DTYPE_FP8})
    write_ready_marker(old_dir, {})
    # Then a bf16 run is told which server stores what, and the fix; a run of the server's
    # dtype, and a bf16 run against the older hook (bf16 only), start
    why = dumps.served_dtype_problem(fp8_dir, DTYPE_BF16)
    assert why is not None and "stores fp8_e4m3 hidden states" in why
    assert f"{ENV_DUMP_DTYPE}=bfloat16" in why and "FARM_STORE_DTYPE" in why
    assert dumps.served_dtype_problem(fp8_dir, DTYPE_FP8) is None
    assert dumps.served_dtype_problem(old_dir, DTYPE_BF16) is None
    assert "stores bfloat16" in (dumps.served_dtype_problem(old_dir, DTYPE_FP8) or "")
    # And ops/preflight.sh says so on the hook's line
    from producer.preflight import check_hook

    line = check_hook(Settings(dump_dir=fp8_dir), None)
    assert line.level == "FAIL" and "stores fp8_e4m3" in line.text, line
    assert check_hook(Settings(dump_dir=fp8_dir, store_dtype="fp8_e4m3"), None).level == "OK"


def test_corrupt_scales_are_caught_by_verify(tmp_path: Path) -> None:
    store = OutputStore(tmp_path / "out", _fp(h=4)).open()
    n = 6

    def parts(scale: float) -> dict[str, Part]:
        return {T_INPUT_IDS: Part.from_array("I64", np.arange(n)),
                T_LOSS_MASK: Part.from_array("I64", np.ones(n)),
                T_HIDDEN: Part.from_array("F8_E4M3", np.full((n, 4), 0x38, np.uint8)),
                T_AUX: Part.from_array("F8_E4M3", np.full((n, 12), 0x38, np.uint8)),
                T_HIDDEN_SCALE: Part.from_array("F32", np.full((n, 1), 0.5, np.float32)),
                T_AUX_SCALE: Part.from_array("F32", np.full((n, 3), scale, np.float32))}

    # Given a good file, then one byte of a scale flipped on disk
    path = store.write("a", parts(0.5), {M_CONTENT: "h"})
    store.verify("a", "h")
    head = tensorfile.read_header(path)
    e = head.tensors[T_AUX_SCALE]
    with open(path, "r+b") as f:
        f.seek(head.data_start + e.begin + 2)
        f.write(b"\xff")
    with pytest.raises(Corrupt, match="checksum of aux_hidden_state_scale"):
        store.verify("a", "h")
    # And a file whose scales are checksummed but not positive (written past the dump's check)
    # is refused by the write's read-back: nothing reaches the final path
    for bad in (0.0, float("nan"), float("inf"), -1.0):
        with pytest.raises(Corrupt, match="aux_hidden_state_scale has 18 scales that are not "
                                          "finite and > 0"):
            store.write("b", parts(bad), {M_CONTENT: "h"})
        with pytest.raises(FileNotFoundError):
            store.verify("b", "h")


def test_the_storage_dtype_is_part_of_the_fingerprint_and_never_mixed(tmp_path: Path) -> None:
    # FARM_STORE_DTYPE: bf16 (the default; the fingerprint says bfloat16 as before) or fp8
    assert Settings.from_env({}).hidden_dtype == DTYPE_BF16
    assert Settings.from_env({"FARM_STORE_DTYPE": "fp8_e4m3"}).hidden_dtype == DTYPE_FP8
    with pytest.raises(ConfigError, match="FARM_STORE_DTYPE must be 'bf16' or 'fp8_e4m3'"):
        Settings.from_env({"FARM_STORE_DTYPE": "fp8"})
    # An fp8 run into a bf16 dir is refused, and the reverse
    for first, second in ((DTYPE_BF16, DTYPE_FP8), (DTYPE_FP8, DTYPE_BF16)):
        out = tmp_path / first
        OutputStore(out, _fp(first)).open()
        with pytest.raises(ConfigError, match=f"dtype: '{second}' != '{first}'"):
            OutputStore(out, _fp(second)).open()


# --- export of an fp8 run into a small file system -------------------------------------------
