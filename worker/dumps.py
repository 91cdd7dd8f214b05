"""Collect the hook's per-request dump from the dump dir (tmpfs) and check it against the request.

The server's HTTP answer can arrive before the writer thread renames the dump into place, so
the worker polls for ``<rid>.safetensors`` or ``<rid>.err`` with a deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path

import numpy as np

from sglang_patch import contracts as c
from worker import tensorfile
from worker.errors import Corrupt, NoSpace, Transient

_POLL_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


def discard_dumps(dump_dir: Path, sample_key: str) -> int:
    """Delete every dump/err of this sample (earlier attempts that died before collecting)."""
    removed = 0
    for p in dump_dir.glob(f"{c.RID_PREFIX}{sample_key}-a*"):
        rid = c.parse_rid(p.name.rsplit(".", 1)[0])
        if rid is not None and rid.sample_key == sample_key:
            p.unlink(missing_ok=True)
            removed += 1
    return removed


async def wait_for_dump(dump_dir: Path, rid: str, timeout_s: float) -> Path:
    """Return the dump's path once it exists.

    Raises:
        Transient: nothing appeared within ``timeout_s``, or the hook ran out of space.
        Corrupt: the hook reported a problem with the request (gap, overrun, truncation).
    """
    dump, err = c.dump_path(dump_dir, rid), c.err_path(dump_dir, rid)
    deadline = time.monotonic() + timeout_s
    for i in itertools.count():
        if dump.exists():
            return dump
        if err.exists():
            message = err.read_text(errors="replace").strip()
            err.unlink(missing_ok=True)
            if message.startswith("dump dir full"):
                raise NoSpace(f"server-side dump failed: {message}")
            raise Corrupt(f"server-side dump failed: {message}")
        if time.monotonic() > deadline:
            raise Transient(f"no dump {dump.name} in {dump_dir} after {timeout_s:.0f}s "
                            "(is SGLANG_HS_DUMP_DIR the same directory? is the hook loaded?)")
        await asyncio.sleep(_POLL_S[min(i, len(_POLL_S) - 1)])
    raise AssertionError("unreachable")  # itertools.count never ends


def load_dump(path: Path, sent_ids: list[int], fingerprint: c.Fingerprint) -> tensorfile.TensorFile:
    """Read a dump and check it against what was sent and the run fingerprint.

    Raises:
        Corrupt: anything does not match; the message lists every problem found.
    """
    tf = tensorfile.read(path)
    t = tf.tensors
    missing = {c.T_INPUT_IDS, c.T_HIDDEN, c.T_AUX} - set(t)
    if missing:
        raise Corrupt(f"dump {path.name} lacks tensors {sorted(missing)}")
    n, h = len(sent_ids), fingerprint.hidden_size
    problems = []
    ids = t[c.T_INPUT_IDS]
    if ids.dtype != "I64" or ids.shape != (n,):
        problems.append(f"input_ids {ids.dtype}{list(ids.shape)}, sent {n} tokens")
    elif not np.array_equal(ids.array, np.asarray(sent_ids, dtype=np.int64)):
        first = int(np.argmax(ids.array != np.asarray(sent_ids)))
        problems.append(f"input_ids differ from those sent (first at position {first})")
    for name, width in ((c.T_HIDDEN, h), (c.T_AUX, c.AUX_LAYERS * h)):
        x = t[name]
        if x.dtype != "BF16" or x.shape != (n, width):
            problems.append(f"{name} is {x.dtype}{list(x.shape)}, expected BF16[{n}, {width}]")
        else:
            bad = tensorfile.bf16_nonfinite(x.array)
            if bad:
                problems.append(f"{name} has {bad} NaN/Inf values")
    problems += _metadata_problems(tf.metadata, fingerprint)
    if problems:
        raise Corrupt(f"dump {path.name}: " + "; ".join(problems))
    return tf


def _metadata_problems(meta: dict[str, str], fp: c.Fingerprint) -> list[str]:
    out = []
    try:
        layers = tuple(json.loads(meta.get(c.M_LAYERS, "null")) or ())
    except ValueError:
        layers = ()
    if layers != fp.layers_to_capture:
        out.append(f"server captures layers {list(layers)}, this run expects "
                   f"{list(fp.layers_to_capture)} (FARM_LAYERS_TO_CAPTURE vs server flags)")
    if meta.get(c.M_CONFIG_SHA) != fp.config_sha256:
        out.append("server's model config differs from the run's (another model is served)")
    return out
