"""The contracts shared by the server-side hook and the farm, in exactly one place.

It imports nothing but the standard library, so the SGLang plugin loads it without the farm
and the worker without torch. It names the rid (``hsd-<run>-<sample_key>-a<attempt>-n<tokens>``),
the dump file (``<dump_dir>/<rid>.safetensors`` or ``.err``), the final file
(``<out>/samples/<shard>/<sample_key>.safetensors``), the run fingerprint (what makes two
files comparable) and the weights identity (which checkpoint a model dir holds: ``weights_hash``).
Test: tests/unit/test_contracts.py::test_rid_round_trip.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from engine_dump import header_codec, weights_hash

PATCH_VERSION = "0.1.0"

# --- rid -------------------------------------------------------------------------------------

RID_PREFIX = "hsd-"
_KEY_CHARS = r"A-Za-z0-9_.\-"
RUN_ID_LEN = 16
# The run a request belongs to leads the rid, at a fixed width, so a rid always parses the
# one way (a sample key may itself hold hex digits and dashes), and every dump file name says
# whose it is: two runs sharing a dump dir never take, collect or delete each other's dumps.
RID_RE = re.compile(rf"^hsd-(?P<run>[0-9a-f]{{{RUN_ID_LEN}}})-(?P<key>[{_KEY_CHARS}]+)"
                    r"-a(?P<attempt>\d+)-n(?P<n>\d+)$")
RUN_ID_RE = re.compile(rf"^[0-9a-f]{{{RUN_ID_LEN}}}$")
MAX_KEY_LEN = 96
# The longest rid of ours: every file of it must be nameable, or not even its ``.err`` can be
# written. Its longest name, the writer's temp ``.err`` (``.<rid>.tmp.<pid>.err``), is 20
# bytes more with a 10-digit pid, under a file system's 255 (NAME_MAX); the longest rid the
# farm makes (a 96-character key) is about 150.
MAX_RID_LEN = 200
# The run of requests that belong to no run (the probe ``sglang_patch verify`` sends)
NO_RUN = "0" * RUN_ID_LEN


@dataclass(frozen=True)
class Rid:
    """A parsed request id: which run, which sample, which attempt, how many tokens were sent."""

    sample_key: str
    attempt: int
    token_count: int
    run: str = NO_RUN

    def __str__(self) -> str:
        return (f"{RID_PREFIX}{self.run}-{self.sample_key}-a{self.attempt}"
                f"-n{self.token_count}")


def make_rid(sample_key: str, attempt: int, token_count: int, run: str = NO_RUN) -> str:
    """Build the rid for one extraction request of run ``run``.

    Raises:
        ValueError: the key is not a sanitised sample key, the run is not a run id, or the
            numbers are out of range.
    """
    if not is_valid_sample_key(sample_key):
        raise ValueError(f"not a sanitised sample key: {sample_key!r}")
    if not RUN_ID_RE.match(run):
        raise ValueError(f"not a run id ({RUN_ID_LEN} hex digits): {run!r}")
    if attempt < 0 or token_count < 1:
        raise ValueError(f"bad attempt/token_count: {attempt}/{token_count}")
    rid = str(Rid(sample_key, attempt, token_count, run))
    if len(rid) > MAX_RID_LEN:
        raise ValueError(f"rid of {len(rid)} characters, over {MAX_RID_LEN}: {rid[:40]}...")
    return rid


def parse_rid(rid: object) -> Rid | None:
    """Parse a rid; None for anything that is not an extraction request of ours, a rid
    too long for its files' names included (over ``MAX_RID_LEN``, or its key over
    ``MAX_KEY_LEN``): the hooks take only a request whose dump or ``.err`` can be written.
    Test: tests/unit/test_contracts.py::test_a_rid_parses_only_if_every_file_name_of_it_fits."""
    if not isinstance(rid, str) or len(rid) > MAX_RID_LEN:
        return None
    m = RID_RE.match(rid)
    if m is None or len(m["key"]) > MAX_KEY_LEN:
        return None
    return Rid(m["key"], int(m["attempt"]), int(m["n"]), m["run"])


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


# --- sample keys -----------------------------------------------------------------------------

_SAFE_KEY_RE = re.compile(rf"^[A-Za-z0-9_][{_KEY_CHARS}]*$")
_UNSAFE_CHAR_RE = re.compile(rf"[^{_KEY_CHARS}]")


def is_valid_sample_key(key: str) -> bool:
    """True if ``key`` is usable as a file name and inside a rid as it is."""
    return len(key) <= MAX_KEY_LEN and bool(_SAFE_KEY_RE.match(key)) and ".." not in key


def is_user_sample_key(key: str) -> bool:
    """A valid key that is not the farm's own (``INTERNAL_KEY_PREFIX``: the canary and the
    probes, dumped in bf16 whatever the run stores): a record's id never becomes one."""
    return is_valid_sample_key(key) and not key.startswith(INTERNAL_KEY_PREFIX)


def sample_key_for(source_id: object, content_sha256: str) -> str:
    """Turn a record's id (any JSON scalar, or None) into a safe, stable sample key.

    A safe id is kept; any other is replaced character by character and suffixed with a hash of
    the original, so two ids never collide by sanitising. A record without an id is keyed by its
    content (``rec-<content hash>``), not its position: two data files both have a record 5, and
    an inserted record would shift every key after it.
    Test: tests/unit/test_contracts.py::test_records_without_id_are_keyed_by_content_not_position.
    """
    if source_id is None:
        return f"rec-{content_sha256[:20]}"
    text = source_id if isinstance(source_id, str) else json.dumps(source_id)
    if is_user_sample_key(text):
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    cleaned = _UNSAFE_CHAR_RE.sub("_", text).replace("..", "__").lstrip("._-")
    cleaned = cleaned[: MAX_KEY_LEN - len(digest) - 1]
    return f"{cleaned}_{digest}" if cleaned else f"id_{digest}"


def shard_of(sample_key: str, shards: int = 256) -> str:
    """The sub-directory a final file lives in: a stable hash bucket, 2 hex digits."""
    bucket = int(hashlib.sha256(sample_key.encode()).hexdigest()[:8], 16) % shards
    return f"{bucket:02x}"


# --- files -----------------------------------------------------------------------------------

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
# Requests the farm sends for itself (the canary, ``sglang_patch verify``) are dumped in bf16
# whatever the server stores: the canary compares unquantized states, as sensitive as in a
# bf16 run (rounding to fp8 would turn a 0.5% numerics change into ~2% of flipped steps).
INTERNAL_KEY_PREFIX = "_hsfarm_"
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


# --- fingerprint -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Fingerprint:
    """What makes two runs' hidden states comparable. Any difference refuses mixing.

    Versions of hsfarm and SGLang are recorded in the manifest beside it but are not part of
    the identity: a bug-fix release must not orphan a half-done multi-day run. Nor is the
    model's path (hosts mount it in different places) or its weights (hundreds of GB to hash):
    the model is identified by its config and tokenizer.
    """

    config_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str
    layers_to_capture: tuple[int, ...]
    layer_convention: str
    hidden_size: int
    dtype: str
    max_tokens: int
    overlong: str

    @cached_property
    def id(self) -> str:
        """A short stable id, used in task ids and Redis keys (computed once)."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["layers_to_capture"] = list(self.layers_to_capture)
        return d

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Fingerprint:
        fields = dict(d)
        fields["layers_to_capture"] = tuple(fields["layers_to_capture"])  # type: ignore[arg-type]
        return cls(**fields)  # type: ignore[arg-type]

    def differences(self, other: Fingerprint) -> list[str]:
        """Human-readable list of fields that differ: ``name: mine != theirs``."""
        a, b = self.to_json(), other.to_json()
        return [f"{k}: {a[k]!r} != {b[k]!r}" for k in a if a[k] != b[k]]


LAYER_CONVENTION = "sglang-capture-input-of-layer"


def default_layers_to_capture(num_layers: int) -> tuple[int, ...]:
    """SGLang's default EAGLE-3 capture ids: the inputs of layers 2, L//2 and L-3.

    These are HF ``hidden_states[i]`` indices (the input of layer i = output of layer i-1),
    the same as SpecForge's draft-config ids [1, L//2-1, L-4] plus one.
    """
    return (2, num_layers // 2, num_layers - 3)



# --- weights identity ------------------------------------------------------------------------
#
# The config and tokenizer (the fingerprint) are the same for a fine-tune of the same model, so
# each weight shard (``*.safetensors`` in the model dir) is identified by its name, its size, the
# sha256 of its safetensors header (tensor names, dtypes, shapes and offsets), the sha256 of a
# few byte ranges sampled at fixed places in its data (``WEIGHTS_SAMPLES`` ranges of
# ``WEIGHTS_SAMPLE_BYTES``: the start, evenly spread middles and the end), and the xxh3-128 of
# every byte of its data (``weights_hash``: read once per file and cached by its identity). A
# truncated shard changes its size and fails the header's own length check; a change of one
# byte anywhere changes the data hash. The sampled ranges cost a few small reads whatever the
# shard's size: they are computed at every start, as the quick check of a cached data hash.
#
# Schemes: ``shards-v1`` (an older hsfarm's) had no data hash, so it could not see a change
# between the sampled ranges (one embedding row); a run recorded under it is still compared
# on the fields it has (``WEIGHTS_SCHEME_FIELDS``), and told what that cannot see.

WEIGHTS_SCHEME = "shards-v2"  # bump when what is hashed changes: two schemes' ids never match
WEIGHTS_SCHEME_V1 = "shards-v1"
WEIGHTS_SCHEME_FIELDS = {
    WEIGHTS_SCHEME_V1: ("size", "header_sha256", "sampled_sha256"),
    WEIGHTS_SCHEME: ("size", "header_sha256", "sampled_sha256", "data_xxh3_128"),
}
WEIGHTS_SAMPLES = 8
WEIGHTS_SAMPLE_BYTES = 64 << 10


class WeightsUnreadable(ValueError):
    """A weight shard is not a whole safetensors file (truncated, damaged, not safetensors)."""


def shard_identity(path: Path) -> dict[str, Any]:
    """One shard's entry without its data hash: name, size, header hash, sampled-ranges hash,
    and (``data_start``) where its data begins.

    Raises:
        WeightsUnreadable: the file is not a whole safetensors file.
        OSError: it cannot be read.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsUnreadable(f"weight shard {path} is truncated: {size} bytes, no header")
        header_len = header_codec.length(head)
        if not header_codec.plausible(header_len, size):
            raise WeightsUnreadable(f"weight shard {path} is truncated or not safetensors: "
                                    f"header of {header_len} bytes in a {size}-byte file")
        header = f.read(header_len)
        data_end = 8 + header_len + _data_bytes(path, header)
        if data_end != size:
            raise WeightsUnreadable(f"weight shard {path} is truncated or damaged: its header "
                                    f"describes {data_end} bytes, the file has {size}")
        sampled = hashlib.sha256()
        for offset in sample_offsets(8 + header_len, size):
            f.seek(offset)
            sampled.update(f.read(WEIGHTS_SAMPLE_BYTES))
    return {"name": path.name, "size": size, "data_start": 8 + header_len,
            "header_sha256": hashlib.sha256(head + header).hexdigest(),
            "sampled_sha256": sampled.hexdigest()}


def _data_bytes(path: Path, header: bytes) -> int:
    try:
        entries, _ = header_codec.decode(header)
        ends = [int(t["data_offsets"][1]) for t in entries.values()]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsUnreadable(f"weight shard {path}: unreadable safetensors header ({e})") from e
    return max(ends, default=0)


def sample_offsets(start: int, size: int) -> list[int]:
    """Where the sampled ranges begin: ``WEIGHTS_SAMPLES`` evenly spaced over [start, size)."""
    if size - start <= WEIGHTS_SAMPLES * WEIGHTS_SAMPLE_BYTES:
        return [start]  # a small shard: its whole data is one range (read up to the end)
    last = size - WEIGHTS_SAMPLE_BYTES
    return [start + (last - start) * i // (WEIGHTS_SAMPLES - 1) for i in range(WEIGHTS_SAMPLES)]


def weights_identity(model_path: Path) -> dict[str, Any]:
    """The identity of the checkpoint in ``model_path``: ``{"scheme", "shards", "id"}``.

    A dir without ``*.safetensors`` shards (a synthetic model, weights in another format) has
    an empty list of shards. The first call for a checkpoint reads all of it (cached by
    ``weights_hash``), later ones its headers and sampled ranges.

    Raises:
        WeightsUnreadable, OSError, ImportError: a shard not whole, unreadable; no xxhash.
    """
    paths = sorted(p for p in model_path.glob("*.safetensors") if p.is_file())
    shards = [shard_identity(p) for p in paths]
    digests = weights_hash.data_hashes(model_path, [
        weights_hash.Shard(p, s.pop("data_start"), s["sampled_sha256"])
        for p, s in zip(paths, shards, strict=True)])
    for s in shards:
        s["data_xxh3_128"] = digests[s["name"]]
    body: dict[str, Any] = {"scheme": WEIGHTS_SCHEME, "shards": shards}
    blob = json.dumps(body, sort_keys=True).encode()
    return {**body, "id": hashlib.sha256(blob).hexdigest()[:16]}


def served_weights(identity: dict[str, Any], model_path: str) -> str:
    """What a server says about the weights it serves, in every dump's metadata (``M_WEIGHTS``):
    the identity's scheme, id and shard count, and the model path it loaded them from."""
    return json.dumps({"scheme": identity.get("scheme"), "id": identity.get("id"),
                       "shards": len(identity.get("shards") or []),
                       "model_path": model_path}, sort_keys=True)
