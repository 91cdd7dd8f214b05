"""Readers of the files ``adopt`` takes: hsfarm output dirs, SpecForge's ``data_<i>.ckpt`` files
and plain torch ``.pt`` dicts with user-given key names; lazy, and never writing a file."""

# Only regular files are read: ``lstat`` first, then ``O_NONBLOCK | O_NOFOLLOW`` and ``fstat``
# on the descriptor, so nothing swapped in between blocks or leads outside SOURCE. Torch files
# load with ``weights_only=True``: a pickle that would run code is refused before it runs.
# States come back as bf16 bit patterns (f16/f32 sources rounded to nearest even), or as an
# hsfarm fp8 run stores them: e4m3 bytes and their float32 scales. Each file opened says which
# file it was (``Identity``: device, inode, size, mtime), so a later open can tell another. Test:
# Test: tests/farm/test_adopt.py::test_odd_entries_in_source_are_refused_by_name_and_enqueue_runs_during_the_scan  # noqa: E501

from __future__ import annotations

import errno
import io
import os
import pickle
import stat
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine_dump.dumpfile import (
    AUX_LAYERS,
    DTYPE_BF16,
    DTYPE_FP8,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    T_INPUT_IDS,
    T_LOSS_MASK,
    is_temp_name,
)
from worker.core import checksums, outdir, tensorfile
from worker.core.errors import ConfigError, Corrupt, SourceFileRefused

SPECFORGE_GLOB = "data_*.ckpt"
HSFARM_MARK = outdir.MANIFEST
# torch format: which dict keys hold what (``--key role=name``; aux may name three keys)
ROLES = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
MAX_UNMAPPED_BYTES = 4 << 30  # a legacy torch file is read whole: at most this
DEFAULT_KEYS: dict[str, tuple[str, ...]] = {r: (r,) for r in ROLES}


@dataclass(frozen=True)
class Identity:
    """A source file as ``fstat`` describes it: another file, or a changed one, differs."""

    device: int
    inode: int
    size_bytes: int
    mtime_ns: int

    @classmethod
    def of(cls, fd: int) -> Identity:
        st = os.fstat(fd)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class SourceSample:
    """One source file's tensors: ids int64 [T], mask int64 [T] or None, states bf16 bits (or
    fp8: e4m3 bytes with their scales)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray | None
    hidden: np.ndarray  # uint16 [T, H] (bf16 bits), or uint8 [T, H] (e4m3 bits)
    aux: np.ndarray  # uint16 [T, 3H], or uint8 [T, 3H]
    dtype: str  # the source's dtype of the states ("bfloat16", "float32", "fp8_e4m3", ...)
    meta: dict[str, str] = field(default_factory=dict)
    verify: Callable[[], None] | None = None  # the source's own checksums, if it has any
    hidden_scale: np.ndarray | None = None  # float32 [T, B] (fp8 only)
    aux_scale: np.ndarray | None = None  # float32 [T, 3B] (fp8 only)
    identity: Identity | None = None  # the file as it was opened

    @property
    def fp8(self) -> bool:
        return self.dtype == DTYPE_FP8


def detect(source: Path) -> str:
    """The format of ``source`` (a dir). Raises ConfigError saying what was found."""
    if (source / HSFARM_MARK).exists() and (source / outdir.SAMPLES_DIR).is_dir():
        return "hsfarm"
    if any(source.glob(SPECFORGE_GLOB)):
        return "specforge"
    found: dict[str, int] = {}
    for p in source.rglob("*"):
        if p.is_file():
            found[p.suffix or p.name] = found.get(p.suffix or p.name, 0) + 1
    what = ", ".join(f"{n} x {s}" for s, n in sorted(found.items())[:8]) or "no files"
    raise ConfigError(
        f"{source}: not a format adopt recognises (found {what}): an hsfarm output dir has "
        f"{HSFARM_MARK} and samples/, SpecForge's has {SPECFORGE_GLOB} files; for other torch "
        "dicts pass --format torch and --key ROLE=NAME")


def list_files(source: Path, fmt: str) -> list[Path]:
    """The files of ``source`` to consider, sorted (names carry no meaning)."""
    if fmt == "hsfarm":
        return sorted(p for p in (source / outdir.SAMPLES_DIR).rglob("*.safetensors")
                      if not is_temp_name(p.name))
    if fmt == "specforge":
        return sorted(source.rglob(SPECFORGE_GLOB))
    return sorted(p for p in source.rglob("*") if p.suffix in (".pt", ".pth", ".ckpt"))


def readable_entry(path: Path, source: Path) -> Path:
    """The path to read for the entry ``path`` of ``source``: itself when it is a regular file
    inside SOURCE, the file a link leads to when that is one.

    Raises:
        SourceFileRefused: a link (or a directory link on the way) that leaves SOURCE, or an
            entry that is not a regular file; never opened.
    """
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
        real, root = Path(os.path.realpath(path)), Path(os.path.realpath(source))
    except OSError as e:
        raise SourceFileRefused(f"unreadable: {e.strerror}") from e
    if not real.is_relative_to(root):
        how = "a symbolic link" if is_link else "reached through a symbolic link"
        raise SourceFileRefused(f"{how} to {real}, outside SOURCE: not read")
    target = source / real.relative_to(root)
    try:
        mode = os.lstat(target).st_mode
    except OSError as e:
        raise SourceFileRefused(f"unreadable: {e.strerror}") from e
    if not stat.S_ISREG(mode):
        raise SourceFileRefused(f"not a regular file ({_kind(mode)}): not read")
    return target


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def _open_regular(path: Path) -> io.FileIO:
    """``path`` opened for reading only if it is a regular file: never through a link in its
    last component, never blocking (a FIFO swapped in after ``readable_entry``).

    Raises:
        SourceFileRefused: a link, not a regular file, or it cannot be opened.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SourceFileRefused("a symbolic link: not followed") from e
        raise SourceFileRefused(f"unreadable: {e.strerror}") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise SourceFileRefused(f"not a regular file ({_kind(mode)}): not read")
    return io.FileIO(fd, "rb", closefd=True)


def parse_keys(specs: list[str]) -> dict[str, tuple[str, ...]]:
    """``["aux_hidden_state=a0,a1,a2", ...]`` → roles to key names (defaults for the rest).

    Raises:
        ConfigError: an unknown role, or not three names for the aux states split in three.
    """
    out: dict[str, tuple[str, ...]] = dict(DEFAULT_KEYS)
    for spec in specs:
        role, _, names = spec.partition("=")
        if role not in ROLES or not names:
            raise ConfigError(f"--key {spec!r}: expected ROLE=NAME[,NAME,NAME] with ROLE one "
                              f"of {', '.join(ROLES)}")
        parts = tuple(n for n in names.split(",") if n)
        if len(parts) not in ((1, AUX_LAYERS) if role == "aux_hidden_state" else (1,)):
            raise ConfigError(f"--key {spec!r}: one name, or {AUX_LAYERS} for aux layers")
        out[role] = parts
    return out


def open_sample(path: Path, fmt: str, keys: dict[str, tuple[str, ...]] | None = None
                ) -> SourceSample:
    """Open one source file lazily. Raises SourceFileRefused with the reason."""
    if fmt == "hsfarm":
        return _open_safetensors(path)
    return _open_torch(path, keys or DEFAULT_KEYS)


# --- hsfarm: safetensors final files ---------------------------------------------------------

_FP8_SCALES = {T_HIDDEN: T_HIDDEN_SCALE, T_AUX: T_AUX_SCALE}


def _open_safetensors(path: Path) -> SourceSample:
    with _open_regular(path) as f:
        identity = Identity.of(f.fileno())
        try:
            header = tensorfile.read_header_fd(f.fileno(), path.name)
        except (Corrupt, OSError) as e:
            raise SourceFileRefused(f"unreadable: {e}") from e
        t = header.tensors
        missing = [n for n in (T_INPUT_IDS, T_HIDDEN, T_AUX) if n not in t]
        if missing:
            raise SourceFileRefused(f"no tensor(s) {missing} (has {sorted(t)})")
        fp8 = _states_dtype(t) == "F8_E4M3"
        mm = np.memmap(f, dtype=np.uint8, mode="r")  # the mapping outlives the descriptor

    def take(name: str) -> np.ndarray:
        e = t[name]
        return mm[header.data_start + e.begin: header.data_start + e.end].view(
            tensorfile.numpy_dtype(e.dtype)).reshape(e.shape)

    def verify() -> None:
        try:
            _, want = checksums.file_checksums(header.metadata)
        except Corrupt:
            return  # a file without checksums: its values are still checked
        algorithm, _ = checksums.file_checksums(header.metadata)
        for name in t:
            if name in want and checksums.tensor_checksum(take(name).data, algorithm) != \
                    want[name]:
                raise SourceFileRefused(f"checksum of {name} differs from its metadata's")

    mask = take(T_LOSS_MASK).astype(np.int64) if T_LOSS_MASK in t else None
    return SourceSample(take(T_INPUT_IDS).astype(np.int64).reshape(-1), mask,
                        take(T_HIDDEN), take(T_AUX), DTYPE_FP8 if fp8 else DTYPE_BF16,
                        dict(header.metadata), verify,
                        hidden_scale=take(T_HIDDEN_SCALE) if fp8 else None,
                        aux_scale=take(T_AUX_SCALE) if fp8 else None, identity=identity)


def _states_dtype(t: dict[str, tensorfile.Entry]) -> str:
    """"BF16" or "F8_E4M3" (with both float32 scales): the states' dtype in an hsfarm file.

    Raises:
        SourceFileRefused: another dtype, the two states in two dtypes, or fp8 without scales.
    """
    dtypes = {t[T_HIDDEN].dtype, t[T_AUX].dtype}
    if dtypes == {"BF16"}:
        return "BF16"
    if dtypes != {"F8_E4M3"}:
        raise SourceFileRefused(f"{T_HIDDEN} is {t[T_HIDDEN].dtype} and {T_AUX} "
                                f"{t[T_AUX].dtype}, expected BF16 or F8_E4M3 (fp8 runs)")
    bad = [s for s in _FP8_SCALES.values() if s not in t or t[s].dtype != "F32"]
    if bad:
        raise SourceFileRefused(f"fp8 states without float32 scales {bad}")
    return "F8_E4M3"


# --- torch: SpecForge's .ckpt and hand-written .pt dicts -------------------------------------

def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ConfigError("reading torch files needs torch: pip install 'hsfarm[training]'") \
            from e
    return torch


def _load_torch(path: Path) -> tuple[dict[str, Any], Identity]:
    torch = _torch()
    with _open_regular(path) as f:
        identity = Identity.of(f.fileno())  # before a byte is read
        return _load_torch_from(torch, f), identity


def _load_torch_from(torch: Any, f: io.FileIO) -> dict[str, Any]:
    try:
        mmap = zipfile.is_zipfile(f)
        size = os.fstat(f.fileno()).st_size
        if not mmap and size > MAX_UNMAPPED_BYTES:
            raise SourceFileRefused(
                f"a legacy (non-zip) torch file of {size / 1e9:.1f} GB would be read whole into "
                "memory; save it again with a torch.save of torch >= 1.6 (zip)")
        f.seek(0)
        # a mapping needs a path: the open descriptor's own, never the name again
        obj = torch.load(f"/proc/self/fd/{f.fileno()}" if mmap else f, map_location="cpu",
                         weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise SourceFileRefused(
            f"refused unloaded: torch's safe loader (weights_only) will not unpickle it: "
            f"{_why(e)}; a pickle that holds more than tensors may run code") from e
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError,
            IndexError, TypeError, AttributeError) as e:
        raise SourceFileRefused(f"unreadable (truncated or corrupt?): {type(e).__name__}: "
                                f"{_why(e)}") from e
    if not isinstance(obj, dict):
        raise SourceFileRefused(f"holds a {type(obj).__name__}, not a dict of tensors")
    return obj


def _why(e: BaseException) -> str:
    """The telling part of a loader's error: the line naming what it refused, or the first
    sentence."""
    text = str(e).strip()
    for line in text.splitlines():
        if "unsupported" in line.lower() or "GLOBAL" in line:
            return line.strip().rstrip(".")[:200]
    return text.split(". ")[0][:200] or type(e).__name__


def _open_torch(path: Path, keys: dict[str, tuple[str, ...]]) -> SourceSample:
    torch = _torch()
    d, identity = _load_torch(path)

    def get(role: str, required: bool = True) -> list[Any] | None:
        names = keys[role]
        if not all(n in d for n in names):
            if not required:
                return None
            raise SourceFileRefused(f"no key(s) {[n for n in names if n not in d]} for "
                                    f"{role} (has {sorted(map(str, d))[:12]}); name them "
                                    "with --key ROLE=NAME")
        out = [d[n] for n in names]
        bad = [n for n, v in zip(names, out, strict=True) if not isinstance(v, torch.Tensor)]
        if bad:
            raise SourceFileRefused(f"{bad} are not tensors")
        return out

    ids_t = get("input_ids")
    hidden_t = get("hidden_state")
    aux_t = get("aux_hidden_state")
    mask_t = get("loss_mask", required=False)
    assert ids_t is not None and hidden_t is not None and aux_t is not None
    ids = _flat_ints(ids_t[0], "input_ids")
    hidden, dtype = _states(hidden_t[0], "hidden_state")
    auxes = [_states(a, "aux_hidden_state")[0] for a in aux_t]
    aux = auxes[0] if len(auxes) == 1 else np.concatenate(auxes, axis=1)
    mask = None if mask_t is None else _flat_ints(mask_t[0], "loss_mask")
    return SourceSample(ids, mask, hidden, aux, dtype, identity=identity)


def _flat_ints(t: Any, name: str) -> np.ndarray:
    torch = _torch()
    if t.is_floating_point() or t.is_complex():
        raise SourceFileRefused(f"{name} is {str(t.dtype).removeprefix('torch.')}, not integers")
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise SourceFileRefused(f"{name} has shape {list(t.shape)}, expected [T] or [1, T]")
    return np.asarray(t.to(torch.int64).numpy())


def _states(t: Any, name: str) -> tuple[np.ndarray, str]:
    """A [T, X] or [1, T, X] float tensor as bf16 bits (uint16 [T, X]) and its dtype's name."""
    torch = _torch()
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise SourceFileRefused(f"{name} has shape {list(t.shape)}, expected [T, X] or "
                                "[1, T, X]")
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise SourceFileRefused(f"{name} is {dtype}; bfloat16, float16 or float32 expected")
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    return np.asarray(t.contiguous().view(torch.int16).numpy()).view(np.uint16), dtype
