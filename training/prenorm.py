"""The pre-norm final state, derived from our post-norm one and the final-norm weight.

speculators wants the last layer's output *before* the final norm (slot 4 of its
``hidden_states``); its ``verifier_norm`` then applies the norm. We store the state after it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from engine_dump.dumpfile import AUX_LAYERS, T_AUX, T_HIDDEN


def prenorm_bf16(hidden_bf16: np.ndarray, weight_f32: np.ndarray) -> np.ndarray:
    """A pre-norm state from the post-norm one: ``hidden / w`` in float32, rounded to bf16.

    RMSNorm(x) = w * x / rms(x) is invariant to scaling x, so the trainer's own norm maps the
    result back to ``hidden`` (to bf16 rounding). Channels where w = 0 are set to 0.
    """
    # One float32 buffer, worked on in place: at T x 7168 the temporaries of the
    # straightforward expression cost more than writing the file (callers pass chunks of rows)
    bits = hidden_bf16.astype(np.uint32)
    bits <<= 16
    x = bits.view(np.float32)
    zero = weight_f32 == 0
    np.divide(x, np.where(zero, 1.0, weight_f32).astype(np.float32), out=x)
    if zero.any():
        x[..., zero] = 0
    return _round_to_bf16(bits)


def f32_to_bf16(y: np.ndarray) -> np.ndarray:
    """float32 → bf16 bits (uint16), round to nearest even, as torch's ``.to(bfloat16)``."""
    return _round_to_bf16(np.array(y, dtype=np.float32).view(np.uint32))


def _round_to_bf16(bits: np.ndarray) -> np.ndarray:
    """float32 bits (uint32, consumed: overwritten) → bf16 bits, round to nearest even."""
    f = bits.view(np.float32)
    nan = np.isnan(f) if np.isnan(f.max(initial=0.0)) else None  # max propagates a NaN
    lsb = bits >> 16
    lsb &= 1
    lsb += np.uint32(0x7FFF)
    bits += lsb
    bits >>= 16
    out = bits.astype(np.uint16)
    if nan is not None:
        out[nan] = 0x7FC0
    return out


STACK_CHUNK_ROWS = 64  # tokens derived at a time: the float32 temporaries stay in cache


def speculators_chunks(a: Mapping[str, np.ndarray], norm_w: np.ndarray,
                       rows: int = STACK_CHUNK_ROWS) -> Iterator[np.ndarray]:
    """speculators' [T, 4, H] stack (bf16 bits), ``rows`` tokens at a time, in order: the
    three aux states, then the pre-norm state. Each chunk is one reused buffer, valid until
    the next is taken."""
    hidden, aux = a[T_HIDDEN], a[T_AUX]
    t, h = hidden.shape
    buf = np.empty((max(1, min(rows, t)), AUX_LAYERS + 1, h), dtype=np.uint16)
    for lo in range(0, t, rows):
        hi = min(lo + rows, t)
        out = buf[: hi - lo]
        out[:, : AUX_LAYERS] = aux[lo:hi].reshape(hi - lo, AUX_LAYERS, h)
        out[:, AUX_LAYERS] = prenorm_bf16(hidden[lo:hi], norm_w)
        yield out


def speculators_stack(a: Mapping[str, np.ndarray], norm_w: np.ndarray) -> np.ndarray:
    """speculators' [T, 4, H] (bf16 bits): the three aux states, then the pre-norm state."""
    t, h = a[T_HIDDEN].shape
    out = np.empty((t, AUX_LAYERS + 1, h), dtype=np.uint16)
    lo = 0
    for chunk in speculators_chunks(a, norm_w):
        out[lo : lo + len(chunk)] = chunk
        lo += len(chunk)
    return out
