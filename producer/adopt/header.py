"""What an hsfarm source file says about itself, against this run: ``adopt``'s header check.

An hsfarm final file names, in its own header, the layers it captured, the fingerprint id and
weights identity of the run that wrote it, and (a dump's key) the dtype of its states. A file
that names other ones than this run holds another run's states: it is refused before
anything is written, with the field named. A file that does not name a field (another tool's,
an older hsfarm's) is judged by its states alone (``adopt_rows``, ``adopt_check``).
"""

from __future__ import annotations

import json

from engine_dump.dumpfile import DTYPE_BF16, M_DUMP_DTYPE, M_LAYERS
from engine_dump.fingerprint import Fingerprint
from worker.core import finalfile
from worker.core.finalfile import M_WEIGHTS_ID


def problems(meta: dict[str, str], fingerprint: Fingerprint, weights_id: str) -> list[str]:
    """Each field of ``meta`` that names something else than this run's, in words."""
    out = []
    layers = _layers(meta.get(M_LAYERS))
    if layers is not None and layers != fingerprint.layers_to_capture:
        out.append(f"its header names layers {list(layers)}, this run captures "
                   f"{list(fingerprint.layers_to_capture)}")
    fp_id = meta.get(finalfile.M_FINGERPRINT)
    if fp_id and fp_id != fingerprint.id:
        out.append(f"its header names fingerprint id {fp_id}, this run's is {fingerprint.id} "
                   "(another model config, tokenizer, chat template, layers, dtype or max "
                   "length)")
    written = meta.get(M_WEIGHTS_ID)
    if written and weights_id and written != weights_id:
        out.append(f"its header names weights identity {written}, this run's is {weights_id} "
                   "(another checkpoint)")
    dtype = meta.get(M_DUMP_DTYPE)
    if dtype and dtype not in (fingerprint.dtype, DTYPE_BF16):
        out.append(f"its header names dtype {dtype}, this run stores {fingerprint.dtype}")
    return out


def _layers(raw: str | None) -> tuple[int, ...] | None:
    """The layer ids a header names; an unparsable entry names ones no run captures."""
    if not raw:
        return None
    try:
        return tuple(int(i) for i in json.loads(raw))
    except (TypeError, ValueError):
        return (-1,)


def refusal(meta: dict[str, str], fingerprint: Fingerprint, weights_id: str) -> str | None:
    """Why the file is refused, or None when its header names nothing foreign."""
    found = problems(meta, fingerprint, weights_id)
    return "; ".join(found) + ": another run's states" if found else None
