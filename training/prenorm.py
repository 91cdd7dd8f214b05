"""The pre-norm final state, derived from our post-norm one and the final-norm weight.

speculators wants the last layer's output *before* the final norm (slot 4 of its
``hidden_states``); its ``verifier_norm`` then applies the norm. We store the state after it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sglang_patch import contracts as c


def prenorm_bf16(hidden_bf16: np.ndarray, weight_f32: np.ndarray) -> np.ndarray:
    """A pre-norm state from the post-norm one: ``hidden / w`` in float32, rounded to bf16.

    RMSNorm(x) = w * x / rms(x) is invariant to scaling x, so the trainer's own norm maps the
    result back to ``hidden`` (to bf16 rounding). Channels where w = 0 are set to 0.
    """
    # One [T, H] float32 buffer, worked on in place: at T x 7168 the temporaries of the
    # straightforward expression cost more than writing the file
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


def speculators_stack(a: Mapping[str, np.ndarray], norm_w: np.ndarray) -> np.ndarray:
    """speculators' [T, 4, H] (bf16 bits): the three aux states, then the pre-norm state."""
    hidden, aux = a[c.T_HIDDEN], a[c.T_AUX]
    t, h = hidden.shape
    out = np.empty((t, c.AUX_LAYERS + 1, h), dtype=np.uint16)
    out[:, : c.AUX_LAYERS] = aux.reshape(t, c.AUX_LAYERS, h)
    out[:, c.AUX_LAYERS] = prenorm_bf16(hidden, norm_w)
    return out
