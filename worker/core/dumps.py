"""Collect the hook's per-request dump from the dump dir (tmpfs) and check it against the request.

The server's HTTP answer can arrive before the writer thread renames the dump into place, so
the worker polls for ``<rid>.safetensors`` or ``<rid>.err`` with a deadline. ``open_dump``
checks its layout, ids and metadata and keeps it open for the store to copy; its values are
checked in the same pass as the copy (``Dump.part``, ``Dump.verdict``). Every file of the dump
dir is opened without following links and checked on the descriptor to be the dump dir's
owner's regular file (``open_file``) before a byte of it is read.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from engine_dump import dumpdir, engines, markers
from engine_dump.dumpfile import (
    DTYPE_BF16,
    ERR_DUMP_DIR_FULL,
    ERR_HOOK_INACTIVE,
    ERR_WRITER_UNHEALTHY,
    M_CONFIG_SHA,
    M_DUMP_DTYPE,
    M_LAYERS,
    M_SERVER_VERSION,
    M_WEIGHTS,
    T_INPUT_IDS,
    dump_path,
    err_path,
    hidden_layout,
    rid_of_file,
)
from engine_dump.fingerprint import Fingerprint
from engine_dump.rids import RID_PREFIX
from worker.core import fp8, tensorfile, weights
from worker.core.errors import ConfigError, Corrupt, NoSpace, ServerMisconfigured, Transient
from worker.core.finalbytes import Part

_POLL_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_WRITER_CHECK_S = 1.0  # how often a wait for a dump reads the writers' notes (a glob)


def discard_dumps(dump_dir: Path, run: str, sample_key: str) -> int:
    """Delete every dump/err of this sample of run ``run`` (earlier attempts that died before
    collecting); another run's dumps of a sample with the same key are never touched."""
    removed = 0
    for p in dump_dir.glob(f"{RID_PREFIX}{run}-{sample_key}-a*"):
        rid = rid_of_file(p.name)
        if rid is not None and rid.run == run and rid.sample_key == sample_key:
            p.unlink(missing_ok=True)
            removed += 1
    return removed


def open_file(path: Path) -> io.FileIO:
    """Open a file of the dump dir for reading: never through a link, only the dump dir's
    owner's regular file that no one else can write (``dumpdir.open_trusted``).

    Raises:
        ConfigError: someone else writes into the dump dir (the worker stops; a person looks).
        OSError: it cannot be opened (FileNotFoundError: it is not there).
    """
    try:
        fd = dumpdir.open_trusted(path)
    except dumpdir.DumpDirUnsafe as e:
        raise ConfigError(str(e)) from e
    return io.FileIO(fd, "rb", closefd=True)


def dump_dir_gone(dump_dir: Path) -> str:
    """What a worker says while its dump dir is gone, with the fix."""
    return (f"dump dir {dump_dir} is gone (deleted, or its tmpfs unmounted): the server can "
            f"write no dump. Make it again as the server's user: mkdir -m 0700 {dump_dir} "
            "(or restart the server, which makes it); work resumes by itself")


def writer_problem(dump_dir: Path) -> str | None:
    """What a worker says while a dump writer of the server is unhealthy (its note, of a
    process not known dead: ``markers.unhealthy_writers``); None when none says so."""
    notes = markers.unhealthy_writers(dump_dir)
    if not notes:
        return None
    said = "; ".join(f"pid {m.info.get('pid')} on {m.info.get('host')}: {m.info.get('why')}"
                     for m in notes)
    return (f"the server's dump writer is unhealthy ({said}): no request can be dumped. "
            "Work resumes by itself once it catches up or the server restarts")


async def wait_for_dump(dump_dir: Path, rid: str, timeout_s: float) -> Path:
    """Return the dump's path once it exists.

    Raises:
        Transient: nothing appeared within ``timeout_s``.
        NoSpace, ServerMisconfigured: the hook reported a fault of the server's environment,
            the dump dir is gone, or the server's dump writer is unhealthy (checked each
            ``_WRITER_CHECK_S``: a dump it refused may only get its ``.err`` later).
        Corrupt: the hook reported a problem with the request (gap, overrun, truncation).
    """
    dump, err = dump_path(dump_dir, rid), err_path(dump_dir, rid)
    deadline = time.monotonic() + timeout_s
    next_writer_check = time.monotonic() + _WRITER_CHECK_S
    for i in itertools.count():
        if dump.exists():
            return dump
        if err.exists():
            with open_file(err) as f:
                message = f.read().decode(errors="replace").strip()
            err.unlink(missing_ok=True)
            if message.startswith(ERR_DUMP_DIR_FULL):
                raise NoSpace(f"server-side dump failed: {message}", on_server=True)
            if message.startswith((ERR_HOOK_INACTIVE, ERR_WRITER_UNHEALTHY)):
                raise ServerMisconfigured(f"server-side dump failed: {message}")
            raise Corrupt(f"server-side dump failed: {message}")
        if not dump_dir.is_dir():  # no dump can come: the environment's fault, not the sample's
            raise ServerMisconfigured(dump_dir_gone(dump_dir))
        if time.monotonic() > next_writer_check:
            next_writer_check = time.monotonic() + _WRITER_CHECK_S
            unhealthy = writer_problem(dump_dir)
            if unhealthy:
                raise ServerMisconfigured(unhealthy)
        if time.monotonic() > deadline:
            raise Transient(f"no dump {dump.name} in {dump_dir} after {timeout_s:.0f}s (is "
                            "the server's SGLANG_HS_DUMP_DIR or HSFARM_VLLM_DUMP_DIR the same "
                            "directory? is the hook loaded?)")
        await asyncio.sleep(_POLL_S[min(i, len(_POLL_S) - 1)])
    raise AssertionError("unreachable")  # itertools.count never ends


class Dump:
    """An open dump whose layout, ids and metadata were checked; its values are checked as
    its parts are copied (``part``'s check), and ``verdict`` reports what was found.

    A context manager. On exit the file is closed, and a ``Part`` taken from it can no longer
    be copied (its ``fileno()`` raises), so a recycled descriptor number is never read.
    """

    def __init__(self, path: Path, file: io.FileIO, header: tensorfile.Header,
                 ids: bytes) -> None:
        self.path = path
        self.file = file
        self.header = header
        self.ids = ids
        self.nonfinite: dict[str, int] = {}
        self.bad_scales: dict[str, int] = {}

    @property
    def metadata(self) -> dict[str, str]:
        return self.header.metadata

    def part(self, name: str) -> Part:
        """One tensor of the dump, to be written into a final file. The bf16 and fp8 ones are
        tested for NaN/Inf piece by piece as the store copies them; fp8 scales (a few bytes
        per token) are read at once and must be finite and > 0."""
        e = self.header.tensors[name]
        if name == T_INPUT_IDS:
            return Part(e.dtype, e.shape, data=self.ids)
        if e.dtype == "F32":
            data = os.pread(self.file.fileno(), e.nbytes, self.header.data_start + e.begin)
            if len(data) != e.nbytes:
                raise Transient(f"reading dump {self.path.name}: short read of {name}")
            self.bad_scales[name] = fp8.bad_scales(np.frombuffer(data, dtype="<f4"))
            return Part(e.dtype, e.shape, data=data)
        self.nonfinite[name] = 0
        count = _count_nonfinite if e.dtype == "BF16" else _count_fp8_nan

        def check(piece: memoryview) -> None:
            self.nonfinite[name] += count(piece)

        return Part(e.dtype, e.shape, source=self.file,
                    offset=self.header.data_start + e.begin, check=check)

    def verdict(self) -> None:
        """Raises Corrupt if the parts copied so far held NaN or Inf values (with counts)."""
        problems = [f"{name} has {n} NaN/Inf values" for name, n in self.nonfinite.items() if n]
        problems += [f"{name} has {n} scales that are not finite and > 0"
                     for name, n in self.bad_scales.items() if n]
        if problems:
            raise Corrupt(f"dump {self.path.name}: " + "; ".join(problems))

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Dump:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_dump(path: Path, sent_ids: list[int], fingerprint: Fingerprint,
              weights_id: str = "") -> Dump:
    """Open a dump and check its layout, ids and metadata (cheap); values are checked as copied.

    Raises:
        Corrupt: anything does not match; the message lists every problem found.
        ServerMisconfigured: its server stores another dtype or layers, or serves another
            config (``identity_problems``) or weights than ``weights_id`` (``served_weights_id``).
        Transient: the dump could not be read.
        ConfigError: it is a link or another user's file (``open_file``)."""
    try:
        f = open_file(path)  # closed by Dump, or below on error
    except OSError as e:
        raise Transient(f"cannot open dump {path.name}: {e}") from e
    try:
        return _check(path, f, sent_ids, fingerprint, weights_id)
    except BaseException:
        f.close()
        raise


def served_dtype_problem(dump_dir: Path, run_dtype: str, writer: str | None = None
                         ) -> str | None:
    """What is wrong when the server writing ``dump_dir`` stores other hidden states than the
    run (the newest live ready marker of its server start says which: the start of ``writer``,
    a probe dump's ``dumpfile.M_WRITER``, in a dump dir servers may share; an older hook's
    says nothing and stores bf16); None when they agree or no marker is there to ask.

    Checked at the worker's start, so a server started without the run's dtype stops the
    worker with the fix before it takes a sample (each dump's own check stays)."""
    try:
        marker, _ = markers.newest_of_server(dump_dir, writer)
    except markers.SharedDumpDir as e:
        return f"{dump_dir}: {e}"
    if marker is None:
        return None
    served = str(marker.info.get("dump_dtype") or DTYPE_BF16)
    if served == run_dtype:
        return None
    return (f"the server writing {dump_dir} stores {served} hidden states (its ready marker "
            f"{marker.path.name}), {_dtype_fix(run_dtype, marker.info)}")


def _dtype_fix(run_dtype: str, said: Mapping[str, object]) -> str:
    """The fix, naming the variable of the engine that wrote ``said`` (a marker's info or a
    dump's metadata: vLLM's hook says ``vllm-<version>``)."""
    vllm = str(said.get("engine") or said.get(M_SERVER_VERSION) or "").startswith(engines.VLLM)
    variable = engines.DUMP_DTYPE_VARIABLE[engines.VLLM if vllm else engines.SGLANG]
    reference = "" if vllm else f" (the reference server: --dump-dtype {run_dtype})"
    return (f"this run stores {run_dtype}: start the server with {variable}={run_dtype}"
            f"{reference}, or use the run's FARM_STORE_DTYPE")


def _check(path: Path, f: io.FileIO, sent_ids: list[int], fp: Fingerprint,
           weights_id: str) -> Dump:
    try:
        header = tensorfile.read_header_fd(f.fileno(), path.name)
        t = header.tensors
        dtype = header.metadata.get(M_DUMP_DTYPE, DTYPE_BF16)
        if dtype != fp.dtype:
            raise ServerMisconfigured(f"dump {path.name} holds {dtype} hidden states, "
                                      f"{_dtype_fix(fp.dtype, header.metadata)}")
        served = identity_problems(header.metadata, fp)
        other = weights.dump_mismatch(header.metadata.get(M_WEIGHTS), weights_id)
        if other:
            served.append(other)
        if served:  # the server's setup, not the sample: the worker waits (no attempt spent)
            raise ServerMisconfigured(f"dump {path.name}: " + "; ".join(served))
        n, h = len(sent_ids), fp.hidden_size
        want = hidden_layout(fp.dtype, n, h, {k: e.shape for k, e in t.items()})
        missing = {T_INPUT_IDS, *want} - set(t)
        if missing:
            raise Corrupt(f"dump {path.name} lacks tensors {sorted(missing)}")
        problems = []
        ids = t[T_INPUT_IDS]
        raw_ids = b""
        if ids.dtype != "I64" or ids.shape != (n,):
            problems.append(f"input_ids {ids.dtype}{list(ids.shape)}, sent {n} tokens")
        else:
            raw_ids = os.pread(f.fileno(), ids.nbytes, header.data_start + ids.begin)
            problems += _ids_problems(raw_ids, sent_ids)
        for name, (tag, shape) in want.items():
            x = t[name]
            if x.dtype != tag or x.shape != shape:
                problems.append(f"{name} is {x.dtype}{list(x.shape)}, expected "
                                f"{tag}{list(shape)}")
    except OSError as e:
        raise Transient(f"reading dump {path.name}: {e}") from e
    if problems:
        raise Corrupt(f"dump {path.name}: " + "; ".join(problems))
    return Dump(path, f, header, raw_ids)


def _ids_problems(raw_ids: bytes, sent_ids: list[int]) -> list[str]:
    got, want = np.frombuffer(raw_ids, dtype="<i8"), np.asarray(sent_ids, dtype=np.int64)
    if len(raw_ids) != want.nbytes:
        return ["input_ids: short read"]
    if np.array_equal(got, want):
        return []
    return [f"input_ids differ from those sent (first at position {int(np.argmax(got != want))})"]


def _count_nonfinite(piece: memoryview) -> int:
    """NaN/Inf values in a piece of bf16 bytes: a fast test, a count only if one is found."""
    values = np.frombuffer(piece, dtype="<u2")
    try:
        return tensorfile.bf16_nonfinite(values) if tensorfile.bf16_any_nonfinite(values) else 0
    finally:
        del values  # no array may outlive the mapping it views


def _count_fp8_nan(piece: memoryview) -> int:
    """NaN values in a piece of float8 e4m3fn bytes (e4m3fn has no Inf)."""
    values = np.frombuffer(piece, dtype=np.uint8)
    try:
        return fp8.nan_count(values)
    finally:
        del values  # no array may outlive the mapping it views


def identity_problems(meta: dict[str, str], fp: Fingerprint) -> list[str]:
    """How a dump's metadata says its server differs from the run (its capture layers, its
    model config), each with the fix; empty when they agree."""
    out = []
    try:
        layers = tuple(json.loads(meta.get(M_LAYERS, "null")) or ())
    except ValueError:
        layers = ()
    if layers != fp.layers_to_capture:
        want = " ".join(str(i) for i in fp.layers_to_capture)
        out.append(f"server captures layers {list(layers)}, this run expects "
                   f"{list(fp.layers_to_capture)} (FARM_LAYERS_TO_CAPTURE vs server flags): "
                   f"restart the server capturing the run's layers (ops/launch-sglang.sh with "
                   f"FARM_LAYERS_TO_CAPTURE=\"{want}\"; the reference server: "
                   f"--layers-to-capture {want})")
    if meta.get(M_CONFIG_SHA) != fp.config_sha256:
        out.append("server's model config differs from the run's (another model is served): "
                   "serve the run's model (its manifest's model), or start a new "
                   "FARM_OUTPUT_DIR for this one")
    return out
