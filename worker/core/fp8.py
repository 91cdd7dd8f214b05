"""Checks of float8 e4m3 hidden states and their scales, on raw bytes (numpy, no torch).

The hook quantizes (``engine_dump/fp8.py``); the worker checks what it copies, as it checks
bf16 for NaN/Inf: e4m3fn has no infinities and two NaN encodings (``0x7F``, ``0xFF``), and
every scale must be finite and > 0 (a NaN or Inf in a block makes its scale non-finite). The
training side dequantizes: ``float(q) * scale``, per block of each token's row of each layer
(``dumpfile.FP8_BLOCK`` values, or the whole row in files written before the blocks), with the
same float32 products as the hook's torch ``dequantize``.
"""

from __future__ import annotations

import numpy as np

from engine_dump.dumpfile import fp8_block_of

_NAN_BITS = 0x7F  # exponent and mantissa all ones; the sign bit either way


def nan_count(values: np.ndarray) -> int:
    """How many e4m3fn values (held as uint8) are NaN."""
    if not values.size:
        return 0
    return int(np.count_nonzero((values & _NAN_BITS) == _NAN_BITS))


def bad_scales(scales: np.ndarray) -> int:
    """How many float32 scales are not finite and > 0 (NaN fails both tests)."""
    return int(scales.size - np.count_nonzero(np.isfinite(scales) & (scales > 0)))


def _e4m3_table() -> np.ndarray:
    bits = np.arange(256, dtype=np.int32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    sub = (man / 8.0) * 2.0 ** -6
    out = sign * np.where(exp == 0, sub, normal)
    out[(bits & _NAN_BITS) == _NAN_BITS] = np.nan
    return out.astype(np.float32)


def _half_step_table() -> np.ndarray:
    """Half the gap from each e4m3 value to the next larger one (magnitude): every value that
    rounds to it lies within that much of it (the gap below a power of two is half as wide)."""
    exp = (np.arange(256, dtype=np.int32) >> 3) & 0xF
    return (np.exp2(np.maximum(exp, 1) - 10.0) / 2).astype(np.float32)


E4M3_VALUES = _e4m3_table()  # the float32 value of every byte
E4M3_HALF_STEPS = _half_step_table()


def dequantize(q: np.ndarray, scales: np.ndarray, *, layers: int) -> np.ndarray:
    """uint8 [T, layers*H] (e4m3fn bits) and float32 [T, layers*blocks] -> float32
    [T, layers*H]. Raises ValueError for a scale shape of neither layout."""
    return _scaled(E4M3_VALUES, q, scales, layers)


def rounding_half_widths(q: np.ndarray, scales: np.ndarray, *, layers: int) -> np.ndarray:
    """How far from ``dequantize``'s value the state each stored byte rounds may lie (float32,
    same shape): the original state lies within value ± half-width."""
    return _scaled(E4M3_HALF_STEPS, q, scales, layers)


def _scaled(table: np.ndarray, q: np.ndarray, scales: np.ndarray, layers: int) -> np.ndarray:
    t, width = q.shape
    h = width // layers
    nb = scales.shape[1] // layers
    if scales.shape[1] != layers * nb:
        raise ValueError(f"{scales.shape[1]} scales per token for {layers} layers")
    block = fp8_block_of(h, nb)
    v = table[q].reshape(t, layers, h)
    if nb * block != h:
        v = np.pad(v, ((0, 0), (0, 0), (0, nb * block - h)))
    v = v.reshape(t, layers, nb, block) * scales.reshape(t, layers, nb, 1)
    return np.ascontiguousarray(v.reshape(t, layers, nb * block)[:, :, :h]).reshape(t, width)
