"""One adopted file's data path: a source file's states written as this run's final file.

bf16 states are copied bit for bit into a bf16 run, and quantized by the hook's own code into
an fp8 run; an fp8 run's files (e4m3 bytes and their scales) are copied as they are into an fp8
run. Every byte is checked as it is copied (NaN/Inf, bad scales) and, when the file was pinned
by the per-file check (``pin``), must be the bytes checked: the store abandons the file before
its rename otherwise. Test:
tests/farm/test_adopt.py::test_adopt_into_an_fp8_run_writes_what_the_hook_writes
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import numpy as np

from engine_dump.dumpfile import (
    AUX_LAYERS,
    DTYPE_FP8,
    M_PATCH_VERSION,
    PATCH_VERSION,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    T_INPUT_IDS,
    T_LOSS_MASK,
)
from producer.adopt import pin as pn
from producer.adopt.formats import SourceSample
from worker.core import checksums, finalfile, tensorfile
from worker.core import fp8 as f8
from worker.core import store as st
from worker.core.errors import Corrupt, NotAsHashed, SourceFileRefused

QUANTIZE_ROWS = 1024  # tokens quantized at once (fp8 runs): bounds the float32 temporaries
_PAIRS = ((T_HIDDEN, T_HIDDEN_SCALE, 1), (T_AUX, T_AUX_SCALE, AUX_LAYERS))


def write_adopted(store: st.OutputStore, key: str, content_sha256: str, s: SourceSample,
                  loss_mask: np.ndarray, meta: dict[str, str],
                  before_write: Callable[[], None] | None = None,
                  pin: pn.Pin | None = None) -> st.Verified:
    """The source's own checksums and its values checked (NaN/Inf), written durably as a final
    file, read back from the device and verified; with ``pin``, only the bytes it names.

    Raises:
        SourceFileRefused: bad values or checksums, not the file or bytes ``pin`` names, or
            the file does not read back whole.
        NoSpace, OutputUnavailable: the output disk failed.
    """
    if pin is not None and (why := pin.problem(s)):
        raise SourceFileRefused(why)
    if s.verify is not None:
        s.verify()
    sums = pin.sums if pin is not None else {}
    bad: dict[str, int] = {}
    parts = {T_INPUT_IDS: _expect(st.Part.from_array("I64", s.input_ids), sums,
                                  T_INPUT_IDS),
             T_LOSS_MASK: st.Part.from_array("I64", loss_mask)}
    if s.fp8:  # (an fp8 run: the scan refuses fp8 files for a bf16 one)
        parts |= _fp8_parts(s, bad, sums)
    elif store.fingerprint.dtype == DTYPE_FP8:
        for name, scale, layers in _PAIRS:
            parts |= _quantized(_states(s, name), layers, name, scale, sums.get(name))
    else:
        parts |= {name: _expect(_bf16_part(_states(s, name), bad, name), sums, name)
                  for name, _, _ in _PAIRS}

    def verdict() -> None:  # every byte was checked as it was copied (in cache)
        found = [f"{n} has {k} {'bad scales' if n.endswith('scale') else 'NaN/Inf values'}"
                 for n, k in bad.items() if k]
        if found:
            raise SourceFileRefused("; ".join(found))

    meta = {**meta, finalfile.M_CONTENT: content_sha256, M_PATCH_VERSION: PATCH_VERSION,
            finalfile.M_ADOPTED_DTYPE: s.dtype}
    if before_write is not None:
        before_write()  # lost the lease (stalled past its TTL): write nothing
    try:
        return store.write_verified(key, parts, meta, validate=verdict)
    except NotAsHashed as e:
        raise SourceFileRefused(f"{pn.CHANGED} ({e}): not adopted, nothing left at its final "
                                "path") from e
    except Corrupt as e:
        raise SourceFileRefused(f"not adopted (nothing left at its final path): {e}") from e


def _states(s: SourceSample, name: str) -> np.ndarray:
    """``s``'s states written as tensor ``name`` (hidden or aux)."""
    return s.hidden if name == T_HIDDEN else s.aux


def _expect(part: st.Part, sums: dict[str, str], name: str) -> st.Part:
    """``part`` with the checksum the pin names for it, if any."""
    want = sums.get(name)
    return part if want is None else dataclasses.replace(part, expect_sum=want)


def _bf16_part(bits: np.ndarray, bad: dict[str, int], name: str) -> st.Part:
    """A bf16 tensor's bytes straight from the source's mapping (no copy when contiguous),
    its NaN/Inf values counted into ``bad[name]`` piece by piece as they are copied."""
    arr = np.ascontiguousarray(bits)
    bad[name] = 0

    def check(piece: memoryview) -> None:
        values = np.frombuffer(piece, dtype="<u2")
        if tensorfile.bf16_any_nonfinite(values):
            bad[name] += tensorfile.bf16_nonfinite(values)

    return st.Part("BF16", tuple(arr.shape), data=arr.data.cast("B"), check=check)


def _fp8_parts(s: SourceSample, bad: dict[str, int], sums: dict[str, str]
               ) -> dict[str, st.Part]:
    """An fp8 file's e4m3 bytes and scales as they are, NaN bytes and scales that are not
    finite and > 0 counted into ``bad`` as they are copied (as a worker checks a dump)."""
    assert s.hidden_scale is not None and s.aux_scale is not None
    arrays = {T_HIDDEN: (s.hidden, "F8_E4M3"), T_AUX: (s.aux, "F8_E4M3"),
              T_HIDDEN_SCALE: (s.hidden_scale, "F32"), T_AUX_SCALE: (s.aux_scale, "F32")}
    out = {}
    for name, (values, dtype) in arrays.items():
        arr = np.ascontiguousarray(values)
        bad[name] = 0

        def check(piece: memoryview, name: str = name, dtype: str = dtype) -> None:
            if dtype == "F32":
                bad[name] += f8.bad_scales(np.frombuffer(piece, dtype="<f4"))
            else:
                bad[name] += f8.nan_count(np.frombuffer(piece, dtype=np.uint8))

        part = st.Part(dtype, tuple(arr.shape), data=arr.data.cast("B"), check=check)
        out[name] = _expect(part, sums, name)
    return out


def _quantized(bits: np.ndarray, layers: int, name: str, scale_name: str,
               expect_sum: str | None) -> dict[str, st.Part]:
    """bf16 states (bits) quantized by the hook's own code (``engine_dump.fp8.quantize``),
    ``QUANTIZE_ROWS`` tokens at a time as the hook quantizes a chunk of a prefill, so an
    adopted file holds what a worker writes from the same states. Each chunk is copied, then
    hashed and quantized: the states quantized are the ones ``expect_sum`` names.

    Raises:
        SourceFileRefused: the states hold NaN/Inf (refused before quantizing, as in bf16), or
            are not the ones ``expect_sum`` names.
    """
    import torch

    from engine_dump import fp8

    h = checksums.new_hasher()
    qs, scales = [], []
    for i in range(0, max(len(bits), 1), QUANTIZE_ROWS):
        values = np.array(bits[i:i + QUANTIZE_ROWS], dtype="<u2")  # one read of the source
        h.update(values.data.cast("B"))
        if tensorfile.bf16_any_nonfinite(values):
            raise SourceFileRefused(f"{name} has {tensorfile.bf16_nonfinite(values)} NaN/Inf "
                                    f"values in tokens {i} to {i + len(values) - 1}")
        with warnings.catch_warnings():  # from_numpy of a copy: quantize never writes it
            warnings.simplefilter("ignore", UserWarning)
            x = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
        q, scale = fp8.quantize(x, layers)
        qs.append(q.numpy())
        scales.append(scale.numpy())
    if expect_sum is not None and h.hexdigest() != expect_sum:
        raise SourceFileRefused(f"{pn.CHANGED} ({name}'s states are not the ones checked): not "
                                "adopted")
    q_all = np.ascontiguousarray(np.concatenate(qs))
    s_all = np.ascontiguousarray(np.concatenate(scales), dtype="<f4")
    return {name: st.Part("F8_E4M3", tuple(q_all.shape), data=q_all.data.cast("B")),
            scale_name: st.Part("F32", tuple(s_all.shape), data=s_all.data.cast("B"))}
