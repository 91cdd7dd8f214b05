"""A final file's format in one place: its metadata keys, its tensors' layout and meaning, checks.

``samples/<shard>/<key>.safetensors`` (``outdir``, docs/output.md). Its metadata: the keys below,
the dump's ``M_LAYERS``, ``M_PATCH_VERSION`` and ``M_SERVER_VERSION`` (``engine_dump.dumpfile``)
and its tensors' checksums (``checksums``). ``finalbytes`` writes and reads its bytes; the store
makes one final. Test: tests/unit/test_store.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine_dump.dumpfile import (
    DTYPE_BF16,
    FP8_BLOCK,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    T_INPUT_IDS,
    T_LOSS_MASK,
    fp8_blocks,
    hidden_layout,
)
from engine_dump.fingerprint import Fingerprint
from worker.core import tensorfile

M_KEY = "sample_key"
M_FINGERPRINT = "fingerprint_id"  # the run's fingerprint id (``Fingerprint.id``)
M_CONTENT = "content_sha256"  # the record's content hash: which version of the record
M_SOURCE_ID = "source_id"  # the record's own id, as JSON
M_SOURCE_FILE = "source_file"  # the data file the record was read from (absolute path)
M_TRUNCATED = "truncated_from"  # the token count before a cut to FARM_MAX_TOKENS ("None": none)
M_WEIGHTS_ID = "weights_id"  # the weights identity the file was written under (``weights``)
# a regenerating run's (worker/regen/record.py): the conversation the states are of, as
# JSON messages, and its generation (settings, each turn's output ids, finish, seed)
M_MESSAGES = "messages"
M_GENERATION = "generation"
M_ADOPTED_FROM = "adopted_from"  # the source file ``adopt`` took the states from
M_ADOPTED_FORMAT = "adopted_format"  # its format (producer/adopt/formats.py)
M_ADOPTED_CHECK = "adopted_check"  # how its states were checked against the server's
M_ADOPTED_DTYPE = "adopted_source_dtype"  # its dtype (an fp8 run quantizes bf16 ones)

FINAL_TENSORS = {  # name -> dtype of a bf16 run's final file (``final_layout`` for any run)
    T_INPUT_IDS: "I64", T_LOSS_MASK: "I64", T_HIDDEN: "BF16", T_AUX: "BF16",
}
SCALES = (T_HIDDEN_SCALE, T_AUX_SCALE)  # an fp8 run's: checked by value at verify
SMALL = {T_INPUT_IDS, T_LOSS_MASK, *SCALES}  # read into memory at verify; the states are not


def conversation_of(meta: Mapping[str, str]) -> dict[str, Any] | None:
    """A regenerating run's file: the conversation its states are of (``messages``) and its
    generation (``generation``: the settings, each turn's output ids, finish and seed), from
    its metadata; None for a file extracted from the conversation given."""
    if M_MESSAGES not in meta:
        return None
    return {"messages": json.loads(meta[M_MESSAGES]),
            "generation": json.loads(meta.get(M_GENERATION, "null"))}


def final_layout(fp: Fingerprint, n: int, found: Mapping[str, tuple[int, ...]] | None = None
                 ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of a final file of ``n`` tokens of run ``fp``: name -> (dtype, shape).
    ``found``: the file's shapes, when checking one (``dumpfile.hidden_layout``: an fp8 file
    of one scale per token per layer, written before the blocks, is checked as one)."""
    return {T_INPUT_IDS: ("I64", (n,)), T_LOSS_MASK: ("I64", (n,)),
            **hidden_layout(fp.dtype, n, fp.hidden_size, found)}


def layout_problems(fp: Fingerprint, t: dict[str, tuple[str, tuple[int, ...]]],
                    ids_shape: tuple[int, ...]) -> list[str]:
    """How tensors ``{name: (dtype, shape)}`` differ from run ``fp``'s final-file layout (an
    fp8 file of one scale per token per layer, written before the blocks, is checked as one)."""
    want = final_layout(fp, ids_shape[0] if ids_shape else -1, {k: s for k, (_, s) in t.items()})
    missing = set(want) - set(t)
    out = [f"missing tensors {sorted(missing)}"] if missing else []
    have = {k: v for k, v in want.items() if k in t}
    out += [f"{k} dtype {t[k][0]} (this run stores {d})" for k, (d, _) in have.items()
            if t[k][0] != d]
    return out + [f"{k} shape {t[k][1]} != {s}" for k, (_, s) in have.items() if t[k][1] != s]


def shape_problems(fp: Fingerprint, header: tensorfile.Header) -> list[str]:
    """How a final file's tensors, dtypes and shapes differ from run ``fp``'s."""
    t = header.tensors
    ids = t[T_INPUT_IDS].shape if T_INPUT_IDS in t else ()
    return layout_problems(fp, {k: (e.dtype, e.shape) for k, e in t.items()}, ids or (-1,))


def header_problems(fp: Fingerprint, header: tensorfile.Header) -> list[str]:
    """How a final file's header differs from run ``fp``'s: fingerprint id, tensors, dtypes
    and shapes (the header alone: no tensor data is read; what relearning "done" checks)."""
    fid = header.metadata.get(M_FINGERPRINT)
    out = [] if fid == fp.id else [f"fingerprint {fid!r}"]
    return out + shape_problems(fp, header)


def identity_problems(meta: Mapping[str, str], key: str, fp: Fingerprint,
                      content_sha256: str | None) -> list[str]:
    """How a final file's metadata differs from what sample ``key`` of run ``fp`` must say:
    its key, the run's fingerprint id and (when given) the record's content hash."""
    out = []
    if meta.get(M_KEY) != key:
        out.append(f"sample_key {meta.get(M_KEY)!r}")
    if meta.get(M_FINGERPRINT) != fp.id:
        out.append(f"fingerprint {meta.get(M_FINGERPRINT)!r} != {fp.id}")
    if content_sha256 is not None and meta.get(M_CONTENT) != content_sha256:
        out.append(f"content hash {meta.get(M_CONTENT)!r} != {content_sha256}")
    return out


# What each tensor is, in words a trainer's author can check: the manifest's ``tensors`` entry.
# Derived from the fingerprint (layer ids and their convention), so it is not part of the
# fingerprint's identity: recording it changes no run's id.

def tensor_semantics(fp: Fingerprint) -> dict[str, object]:
    """The manifest's ``tensors`` entry for a run with fingerprint ``fp``."""
    sglang_ids = list(fp.layers_to_capture)
    output_ids = [i - 1 for i in sglang_ids]
    kind = "bf16" if fp.dtype == DTYPE_BF16 else "float8 e4m3fn"
    nb, block = fp8_blocks(fp.hidden_size), FP8_BLOCK
    scales = {} if fp.dtype == DTYPE_BF16 else {
        T_HIDDEN_SCALE: f"float32 [T, {nb}]: hidden_state's scales, one per block of {block} "
                        "values of a token's row (the last block may be shorter): value = "
                        "float(e4m3) * scale, scale = max|block| / 448; a file whose scales "
                        "are [T, 1] (written before the blocks) has one per row",
        T_AUX_SCALE: f"float32 [T, {3 * nb}]: aux_hidden_state's scales, {nb} per layer, "
                     f"layer by layer, as hidden_state's (columns i*{nb} to (i+1)*{nb} - 1 "
                     "scale the i-th layer); a file whose scales are [T, 3] has one per "
                     "token per layer"}
    return {
        T_INPUT_IDS: "int64 [T]: the token ids sent to the server (chat template applied)",
        T_LOSS_MASK: "int64 [T]: 1 on tokens an assistant message adds (content and end of "
                     "turn), else 0; not shifted",
        T_HIDDEN: f"{kind} [T, {fp.hidden_size}]: the final hidden state AFTER the model's final "
                  "norm (the LM head's input); final_norm.safetensors holds the norm weight, "
                  "so hidden_state / weight is a pre-norm state the same norm maps back",
        T_AUX: f"{kind} [T, {3 * fp.hidden_size}]: three states concatenated in this order: the "
               f"inputs of layers {sglang_ids} (SGLang's convention, HF hidden_states[i]) = "
               f"the outputs of layers {output_ids} (0-based, Model-Optimizer's convention)",
        "aux_layers_sglang": sglang_ids,
        "aux_layers_output_0based": output_ids,
        "hidden_state_norm": "post",
        "min_tokens": 2,
        **scales,
    }
