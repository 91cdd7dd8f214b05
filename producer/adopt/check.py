"""The compatibility check of ``adopt``: K matched source files extracted again through the
live server as the canary extracts them, compared per layer with the canary's tolerance."""

# Over the tolerance, it names the likely cause from what the numbers show: every layer off
# (another checkpoint); only aux layers off (other layers; an off-by-one when an adjacent
# captured layer matches); only the final state off until the final RMSNorm is applied (pre-norm).
# A file of fp8 states is compared by where the server's state lies from the interval of values
# that round to each stored e4m3 byte (``worker.core.fp8.rounding_half_widths``): the server's
# state is compared with the nearest point of that interval, a lower bound of its difference from
# the state the file rounded, so a file of the run's model passes as its bf16 states would; a
# difference within e4m3's rounding (up to 6.25% of a value) goes unseen.
# Tests: tests/farm/test_adopt.py::test_off_by_one_layers_diagnosed,
# tests/unit/test_adopt.py::test_pre_norm_final_state_diagnosed.

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine_dump.dumpfile import AUX_LAYERS, T_AUX, T_AUX_SCALE, T_HIDDEN, T_HIDDEN_SCALE
from engine_dump.fingerprint import Fingerprint
from producer.adopt.formats import SourceSample
from worker.core import canary as cn
from worker.core import final_norm
from worker.core import fp8 as f8
from worker.core.settings import Settings
from worker.server.canary_check import extract
from worker.server.client import ServerClient

MAX_DEFAULT_K = 32
ROWS = cn.ROWS_PER_PROMPT
WIDTH_MARGIN = 1 + 2 ** -10  # float32 rounding of the hook's division and of value * scale


def default_k(n_matched: int) -> int:
    """At least 3, about sqrt(n) for bigger sources, at most 32 (never more than there are)."""
    return min(n_matched, min(MAX_DEFAULT_K, max(3, math.ceil(math.sqrt(n_matched)))))


@dataclass(frozen=True)
class Picked:
    """One file chosen for the check: its name, the ids sent, and its states at ``rows``."""

    name: str
    input_ids: list[int]
    rows: np.ndarray
    states: np.ndarray  # float32 [4, R, H]: aux layers, then final (bf16 values)
    width: np.ndarray | None = None  # fp8: how far from ``states`` the rounded states may lie

    def recorded(self, new: np.ndarray) -> cn.Canary:
        """The file's states to compare with the server's ``new``: as stored (bf16), or the
        point of each value's rounding interval nearest to the server's (fp8)."""
        states = self.states if self.width is None else np.clip(
            new, self.states - self.width, self.states + self.width)
        return cn.Canary(np.asarray(self.input_ids), self.rows, states)


@dataclass(frozen=True)
class CheckResult:
    comparison: cn.Comparison
    files: list[str]
    diagnosis: str  # empty when passed

    @property
    def passed(self) -> bool:
        return self.comparison.passed

    def lines(self) -> list[str]:
        head = (f"compatibility check: {len(self.files)} files extracted again through the "
                f"server: {'passed' if self.passed else 'FAILED'}")
        out = [head, self.comparison.table()]
        if self.diagnosis:
            out.append(f"likely cause: {self.diagnosis}")
        return out

    def to_json(self) -> dict[str, object]:
        return {"files": self.files, "passed": self.passed,
                "max_rel_tol": self.comparison.max_rel_tol,
                "mean_rel_tol": self.comparison.mean_rel_tol,
                "layers": [{"name": e.name, "max_rel": e.max_rel, "mean_rel": e.mean_rel}
                           for e in self.comparison.layers],
                "diagnosis": self.diagnosis}


def pick(names: list[str], k: int, seed: int | None = None) -> list[str]:
    """``k`` of ``names`` at random (``seed`` for a repeatable choice)."""
    return sorted(random.Random(seed).sample(names, min(k, len(names))))


def rows_of(n_tokens: int) -> np.ndarray:
    """Which token rows are compared: evenly spaced ones, the first and last included."""
    return cn.sample_rows(n_tokens, 0)


def picked(name: str, s: SourceSample, rows: np.ndarray) -> Picked:
    """``s``'s ids up to its last row and its states at ``rows`` (read from its mapping)."""
    at = {T_HIDDEN: s.hidden[rows], T_AUX: s.aux[rows]}
    if s.hidden_scale is not None and s.aux_scale is not None:
        at |= {T_HIDDEN_SCALE: s.hidden_scale[rows], T_AUX_SCALE: s.aux_scale[rows]}
    return picked_of_rows(name, s.input_ids[:int(rows[-1]) + 1].tolist(), rows, at)


def picked_of_rows(name: str, ids: list[int], rows: np.ndarray,
                   at: Mapping[str, np.ndarray]) -> Picked:
    """A ``Picked`` from a file's tensors at ``rows`` (by tensor name; fp8: with scales)."""
    if T_HIDDEN_SCALE not in at:
        return Picked(name, ids, rows, states_at(at[T_HIDDEN], at[T_AUX],
                                                 np.arange(len(rows))))
    pairs = ((T_AUX, T_AUX_SCALE, AUX_LAYERS), (T_HIDDEN, T_HIDDEN_SCALE, 1))
    values = [f8.dequantize(at[q], at[sc], layers=n) for q, sc, n in pairs]
    widths = [f8.rounding_half_widths(at[q], at[sc], layers=n) * WIDTH_MARGIN
              for q, sc, n in pairs]
    return Picked(name, ids, rows, _layout(values[0], values[1]), _layout(widths[0], widths[1]))


def states_at(hidden: np.ndarray, aux: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """bf16 bits [T, H] and [T, 3H] → float32 [4, R, H] at ``rows`` (the canary's layout)."""
    return _layout(cn.from_bf16(np.asarray(aux[rows])), cn.from_bf16(np.asarray(hidden[rows])))


def _layout(aux: np.ndarray, fin: np.ndarray) -> np.ndarray:
    """float32 [R, 3H] and [R, H] → [4, R, H]: aux layers, then final."""
    r, h = fin.shape
    return np.concatenate([aux.reshape(r, AUX_LAYERS, h).transpose(1, 0, 2), fin[None]],
                          axis=0)


def run_check(settings: Settings, run_id: str, fingerprint: Fingerprint, out_dir: Path,
              picked: list[Picked]) -> CheckResult:
    """Extract ``picked`` again through the server and compare.

    Raises:
        ServerUnavailable, Transient, Corrupt: the server could not answer for a file.
    """
    new = extract_again(settings, run_id, picked)
    names = cn.layer_names(fingerprint.layers_to_capture)
    recorded = [p.recorded(n) for p, n in zip(picked, new, strict=True)]
    cmp = cn.compare(recorded, new, names, settings.canary_max_rel_err,
                     settings.canary_mean_rel_err)
    why = "" if cmp.passed else diagnose(cmp, recorded, new, fingerprint, _norm(out_dir))
    return CheckResult(cmp, [p.name for p in picked], why)


def extract_again(settings: Settings, run_id: str, picked: list[Picked]) -> list[np.ndarray]:
    """``picked``'s ids sent to the server at once (the canary's request); the dumps' states
    at each one's rows, float32 [4, R, H].

    Raises:
        ServerUnavailable, Transient, Corrupt: the server could not answer for a file.
    """
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_extract_all(settings, run_id, picked))
    finally:
        loop.close()


async def _extract_all(settings: Settings, run_id: str, picked: list[Picked]
                       ) -> list[np.ndarray]:
    client = ServerClient.of(settings)
    try:
        got = await extract(client, settings.dump_dir, [p.input_ids for p in picked],
                            [p.rows for p in picked], settings.dump_timeout_s, run=run_id,
                            backoff_s=settings.retry_backoff_s,
                            backoff_max_s=settings.retry_backoff_max_s)
    finally:
        await client.close()
    return [states for states, _ in got]


def _norm(out_dir: Path) -> Callable[[np.ndarray], np.ndarray] | None:
    """The run's final RMSNorm as a function on [.., H] float32, or None if not recorded."""
    try:
        norm = final_norm.load_final_norm(out_dir)
    except (OSError, ValueError, KeyError):
        return None
    w, eps = norm.as_float32(), norm.rms_norm_eps

    def apply(x: np.ndarray) -> np.ndarray:
        x64 = x.astype(np.float64)
        return x64 / np.sqrt((x64 ** 2).mean(axis=-1, keepdims=True) + eps) * w

    return apply


def _err(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[float, float]:
    """(max, mean) relative error of rows ``a`` against ``b`` over every file."""
    e = np.concatenate([cn.relative_errors(x, y) for x, y in zip(a, b, strict=True)])
    return float(e.max(initial=0.0)), float(e.mean()) if e.size else 0.0


def diagnose(cmp: cn.Comparison, recorded: list[cn.Canary], new: list[np.ndarray],
             fingerprint: Fingerprint, norm: Callable[[np.ndarray], np.ndarray] | None
             ) -> str:
    """What the failed comparison most likely means (see the module's docstring)."""
    def ok(e: tuple[float, float]) -> bool:
        return e[0] <= cmp.max_rel_tol and e[1] <= cmp.mean_rel_tol

    def layer(states: list[np.ndarray], i: int) -> list[np.ndarray]:
        return [s[i] for s in states]

    mine = [r.states for r in recorded]
    bad = [i for i, e in enumerate(cmp.layers) if not ok((e.max_rel, e.mean_rel))]
    final = len(cmp.layers) - 1
    if final not in bad:
        return _other_layers(bad, mine, new, fingerprint, ok, layer)[1]
    if not [i for i in bad if i != final]:
        if norm is not None and ok(_err([norm(s) for s in layer(mine, final)],
                                        layer(new, final))):
            return ("the files' final state is the one before the model's final norm "
                    "(pre-norm); this run stores it after the norm (post-norm)")
        return ("the final state alone differs: another final norm or head, or another "
                "checkpoint that shares the aux layers")
    proven, shifted = _other_layers(bad, mine, new, fingerprint, ok, layer)
    if proven:
        return shifted
    return ("another model or checkpoint: every layer differs, the final state too (another "
            "fine-tune, another revision or quantisation of the weights; or the server now "
            "serves another model: see the canary)")


def _other_layers(bad: list[int], mine: list[np.ndarray], new: list[np.ndarray],
                  fp: Fingerprint, ok: Callable[[tuple[float, float]], bool],
                  layer: Callable[[list[np.ndarray], int], list[np.ndarray]]
                  ) -> tuple[bool, str]:
    """(proven, text): proven when a file's layer equals the server's capture of a layer
    next to it."""
    ids = fp.layers_to_capture
    found = []
    for j in bad:
        if j >= len(ids):
            continue
        for k, other in enumerate(ids):
            if k != j and abs(other - ids[j]) == 1 and ok(_err(layer(mine, j), layer(new, k))):
                found.append((j, k))
    if found:
        j, k = found[0]
        side = ("the output of layer {i} (= the input of layer {n})" if ids[k] > ids[j]
                else "the input of layer {p}")
        what = side.format(i=ids[j], n=ids[j] + 1, p=ids[j] - 1)
        return True, (f"off-by-one layers: the files' aux layer {ids[j]} equals this run's capture "
                f"of layer {ids[k]}, so the files hold {what} where this run (SGLang's "
                f"convention) takes the input of layer {ids[j]}: the source's layers are not "
                "this run's; extract these samples again")
    names = ", ".join(f"aux layer {ids[j]}" for j in bad if j < len(ids))
    return False, (f"other layers: {names} differ while the final state matches (same model). The "
            "common cause is the off-by-one between 'input of layer i' (SGLang, this run) "
            "and 'output of layer i' (HF hidden_states[i+1]); the run captures no adjacent "
            "layer to prove it")
