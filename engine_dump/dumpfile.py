"""A dump file: its name in the dump dir, its tensors, its metadata keys, its storage dtype.

The hook writes ``<dump_dir>/<rid>.safetensors`` (or ``<rid>.err``) through a hidden temp file;
the worker reads it and writes the final file, which keeps the tensor names (SpecForge's offline
key names) and the dtype. Standard library only: the hooks load it without the farm and the
worker without torch. Test: tests/unit/test_rids.py, tests/unit/test_fp8.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from engine_dump import header_codec
from engine_dump.rids import INTERNAL_KEY_PREFIX, Rid, parse_rid

PATCH_VERSION = "0.1.0"  # the hooks' version, in every dump's metadata (``M_PATCH_VERSION``)

DUMP_SUFFIX = ".safetensors"
ERR_SUFFIX = ".err"
READY_PREFIX = ".ready."
# A hook process's note that its dump writer cannot keep up or no longer runs (``markers``)
WRITER_UNHEALTHY_PREFIX = ".writer-unhealthy."
TMP_MARK = ".tmp."  # every temp file of ours contains this, so cleanup can find them

# How a ``.err`` file starts when the fault is the server's environment, not the request: the
# worker then waits (holding its message, spending no attempt) instead of retrying the sample.
ERR_DUMP_DIR_FULL = "dump dir full"
ERR_HOOK_INACTIVE = "the hsfarm dump hook is not active"
ERR_WRITER_UNHEALTHY = "the hsfarm dump writer is unhealthy"

# Tensor names, shared by the dump file and the final file (SpecForge's offline key names).
T_INPUT_IDS = "input_ids"
T_LOSS_MASK = "loss_mask"
T_HIDDEN = "hidden_state"
T_AUX = "aux_hidden_state"
AUX_LAYERS = 3

# Metadata keys written by the hook into every dump.
M_LAYERS = "layers_to_capture"
M_CONFIG_SHA = "model_config_sha256"
M_PATCH_VERSION = "patch_version"
M_SERVER_VERSION = "server_version"
M_RID = "rid"
M_WEIGHTS = "weights_identity"  # JSON: ``served_weights`` of the weights the server loaded
# The process that wrote the dump, in the words of its ready marker (``markers.writer_id``):
# which server start of a shared dump dir a dump came from
M_WRITER = "writer"


# --- storage dtype ---------------------------------------------------------------------------
#
# Hidden states are stored as bf16 (the default) or, opt-in, as float8 e4m3 with float32
# scales per block of ``FP8_BLOCK`` values of each token's row of each layer (DeepSeek's FP8
# layout): ``x ≈ float(q) * scale``, ``scale = max|block| / 448``. A massive channel (10^3-10^5
# above the rest, as residual streams have) then coarsens only its own block, where one scale
# per row would flush the small values of the whole row to zero. The hook quantizes (on the GPU,
# before the copy to the host), so the dump and the final file hold the same bytes. The run's
# fingerprint names the dtype: one output dir never mixes the two.
#
# The block is not part of the fingerprint nor of the ready marker: a file says its own layout
# by its scales' shape ([T, layers * ceil(H / FP8_BLOCK)], or [T, layers]: one scale per token
# per layer, which the hook does not write), every reader takes both, and both hold the same
# states up to e4m3's rounding. Naming it in the fingerprint would change every fp8 run's id
# and refuse the output dirs of runs in flight.

DTYPE_BF16 = "bfloat16"
DTYPE_FP8 = "fp8_e4m3"
STORE_DTYPES = (DTYPE_BF16, DTYPE_FP8)
FP8_MAX = 448.0  # the largest finite float8 e4m3fn value
FP8_BLOCK = 128  # values per scale along a layer's row (the last block of a row may be shorter)
T_HIDDEN_SCALE = "hidden_state_scale"  # F32 [T, ceil(H / FP8_BLOCK)]
T_AUX_SCALE = "aux_hidden_state_scale"  # F32 [T, 3 * ceil(H / FP8_BLOCK)]: layer by layer
M_DUMP_DTYPE = "hidden_dtype"  # in a dump's metadata; a dump without it is bf16
ENV_DUMP_DTYPE = "SGLANG_HS_DUMP_DTYPE"  # the server's storage dtype (the hook, the reference)


def dump_dtype_for(rid: Rid, server_dtype: str) -> str:
    """The dtype the hook dumps request ``rid`` in: the server's, bf16 for the farm's own."""
    return DTYPE_BF16 if rid.sample_key.startswith(INTERNAL_KEY_PREFIX) else server_dtype


def fp8_blocks(h: int, block: int = FP8_BLOCK) -> int:
    """Scales per token per layer of hidden size ``h``: one per ``block`` values."""
    return -(-h // block)


def fp8_block_of(h: int, blocks: int) -> int:
    """The block of a layer's row of ``h`` values that holds ``blocks`` scales per token:
    ``FP8_BLOCK``, or ``h`` (one scale per row, which the hook does not write). Raises
    ValueError for any other count."""
    if blocks == 1:
        return h
    if blocks == fp8_blocks(h):
        return FP8_BLOCK
    raise ValueError(f"{blocks} fp8 scales per token per layer of {h} values: expected "
                     f"{fp8_blocks(h)} (one per {FP8_BLOCK}) or 1")


def hidden_layout(dtype: str, n: int, h: int, found: Mapping[str, tuple[int, ...]] | None = None
                  ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The hidden-state tensors of a dump or final file of ``n`` tokens, hidden size ``h``:
    name -> (safetensors dtype tag, shape). Raises ValueError for an unknown dtype.

    ``found`` (a file's tensor shapes, for a reader's check): an fp8 file whose scales are one
    per token per layer gets that layout (the hook does not write it); any other the block
    layout."""
    if dtype == DTYPE_BF16:
        return {T_HIDDEN: ("BF16", (n, h)), T_AUX: ("BF16", (n, AUX_LAYERS * h))}
    if dtype == DTYPE_FP8:
        per_row = found is not None and found.get(T_HIDDEN_SCALE) == (n, 1) \
            and found.get(T_AUX_SCALE) == (n, AUX_LAYERS)
        blocks = 1 if per_row else fp8_blocks(h)
        return {T_HIDDEN: ("F8_E4M3", (n, h)), T_AUX: ("F8_E4M3", (n, AUX_LAYERS * h)),
                T_HIDDEN_SCALE: ("F32", (n, blocks)),
                T_AUX_SCALE: ("F32", (n, AUX_LAYERS * blocks))}
    raise ValueError(f"unknown storage dtype {dtype!r}: one of {', '.join(STORE_DTYPES)}")


def bytes_per_token(dtype: str, h: int) -> int:
    """Bytes one token takes in a dump: its id and its hidden states (with scales)."""
    return 8 + sum(header_codec.TAG_BYTES[tag] * shape[1]
                   for tag, shape in hidden_layout(dtype, 1, h).values())


def dump_path(dump_dir: Path, rid: str) -> Path:
    return dump_dir / f"{rid}{DUMP_SUFFIX}"


def err_path(dump_dir: Path, rid: str) -> Path:
    return dump_dir / f"{rid}{ERR_SUFFIX}"


def is_temp_name(name: str) -> bool:
    """True for a temp file of ours: a hidden name (no sample key, rid or run file starts
    with a dot) holding ``TMP_MARK``. A key may itself contain ``.tmp.`` (``a.tmp.b`` is a
    valid record id): its final file is never taken for a temp file."""
    return name.startswith(".") and TMP_MARK in name


def rid_of_file(name: str) -> Rid | None:
    """The rid a dump dir entry belongs to: ``<rid>.safetensors``, ``<rid>.err`` or the
    hook's temp file ``.<rid>.tmp.<pid>``; None for any other name."""
    if is_temp_name(name):
        # the writer's part follows the last mark: the key itself may hold one
        return parse_rid(name[1:].rsplit(TMP_MARK, 1)[0])
    for suffix in (DUMP_SUFFIX, ERR_SUFFIX):
        if name.endswith(suffix):
            return parse_rid(name[: -len(suffix)])
    return None
