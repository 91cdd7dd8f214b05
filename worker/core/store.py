"""The output directory: manifest, durable final files, verification from disk, cleanup.

``<out>/manifest.json`` (``manifest``) and ``<out>/samples/<shard>/<key>.safetensors``
(docs/output.md; the file's format: ``finalfile``). A write is temp file → fsync → read back
from the device → rename → fsync(dir), so a file that does not read back whole never takes a
final path. Data streams through ``finalbytes`` in bounded chunks; no step holds a whole tensor.
Test: tests/unit/test_store.py::
test_a_file_that_does_not_read_back_whole_never_takes_its_final_path."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine_dump.dumpfile import T_INPUT_IDS
from engine_dump.fingerprint import Fingerprint
from worker.core import (
    checksums,
    diskio,
    durable,
    final_norm,
    finalfile,
    fp8,
    outdir,
    run,
    tensorfile,
    weights,
)
from worker.core import manifest as manifests
from worker.core.errors import (
    ConfigError,
    Corrupt,
    LeaseLost,
    NoSpace,
    OutputUnavailable,
)
from worker.core.finalbytes import Part, read_back, write_parts

log = logging.getLogger("hsfarm.store")


@dataclass(frozen=True)
class Verified:
    path: Path
    tokens: int
    size_bytes: int
    # What was read back, for callers that check more (audit): the metadata and the small
    # tensors (input_ids, loss_mask). The hidden states were checked in passing, not kept.
    file: tensorfile.TensorFile


class OutputStore:
    """One run's output directory. ``open`` checks or writes the manifest first."""

    def __init__(self, out_dir: Path, fingerprint: Fingerprint,
                 versions: dict[str, str] | None = None, debug_write_delay_s: float = 0.0,
                 model_path: Path | None = None) -> None:
        self.out_dir = out_dir
        self.model_path = model_path  # where the final-norm weight is read from (new manifests)
        self.fingerprint = fingerprint
        self.versions = versions or {}
        self.debug_write_delay_s = debug_write_delay_s
        self.weights_id = ""  # the checkpoint's identity (weights.py), once opened with a model
        # what every dump's server must say it serves (this hsfarm's scheme); "" when nothing
        # can be compared (``served_weights_id``)
        self.served_weights_id = ""
        self.run_id = ""  # the run this output dir holds (worker/core/run.py), once opened
        self.weights_local: dict[str, object] | None = None  # FARM_MODEL_PATH's identity
        self.weights_recorded: dict[str, object] | None = None  # the manifest's

    def open(self) -> OutputStore:
        """Create the dir and manifest, or check that the existing manifest matches.

        With a model path, the checkpoint's weights identity is recorded in a new manifest
        and checked against an existing one's, before any request is sent.

        Raises:
            ConfigError: the directory belongs to a run with a different fingerprint, or to
                other weights; or a weight shard is truncated; or it cannot be written.
        """
        try:
            self._open()
        except OSError as e:
            raise ConfigError(f"the output dir {self.out_dir} cannot be written ({e}); "
                              "make it writable (a read-only or failing file system? "
                              "permissions?), or set FARM_OUTPUT_DIR") from e
        problem = writable_problem(self.out_dir)
        if problem:
            raise ConfigError(f"{problem}; make it writable, or set FARM_OUTPUT_DIR")
        return self

    def _open(self) -> None:
        (self.out_dir / outdir.SAMPLES_DIR).mkdir(parents=True, exist_ok=True)
        identity = None if self.model_path is None else weights.weights_identity(self.model_path)
        if not manifests.path(self.out_dir).exists():  # another worker's first: then compare
            manifests.create(self.out_dir, self.fingerprint, uuid.uuid4().hex, self.versions,
                             finalfile.tensor_semantics(self.fingerprint),
                             self._write_final_norm(), identity)
        manifest = manifests.read(self.out_dir)
        manifests.check(manifest, self.fingerprint, self.out_dir)
        if identity is not None:
            self._check_weights(manifest, identity)
        self.run_id = run.run_id(manifest)

    def _check_weights(self, manifest: dict[str, object], identity: dict[str, object]) -> None:
        self._check_recorded(manifest, identity)
        self.served_weights_id = self._served_id()

    def _served_id(self) -> str:
        """The identity a dump's server must publish: the run's when recorded under this
        hsfarm's scheme, else FARM_MODEL_PATH's once it matched what the run recorded (a run
        started by an older hsfarm, whose ``weights_id`` is of its older scheme and so never
        what a server of this one publishes); "" when neither has shards to compare."""
        for identity in (self.weights_recorded, self.weights_local):
            if identity and identity.get("scheme") == weights.SCHEME and identity.get("shards"):
                return str(identity.get("id"))
        return ""

    def _check_recorded(self, manifest: dict[str, object], identity: dict[str, object]) -> None:
        recorded = manifests.recorded_weights(manifest)
        self.weights_local = identity
        self.weights_recorded = recorded if isinstance(recorded, dict) else None
        if isinstance(recorded, dict):
            unknown = weights.incomparable(recorded, identity)
            if unknown:  # nothing to compare here: the canary alone guards the served model
                log.warning("the weights cannot be checked against the run's identity here "
                            "(%s); the canary guards the served model, and files written "
                            "here carry the run's identity %s", unknown, recorded.get("id"))
                self.weights_id = str(recorded.get("id"))
                return
            why = weights.mismatch(recorded, identity, self.model_path or self.out_dir)
            if why:
                raise ConfigError(why)
            if weights.older_scheme(recorded):  # files keep the run's own identity
                log.warning("the weights in %s match the run's identity %s as far as it can "
                            "tell: %s", self.model_path, recorded.get("id"), weights.V1_BLIND)
                self.weights_id = str(recorded.get("id"))
                return
        else:  # a run started before the identity existed: keep it running, say what is unchecked
            log.warning("%s/%s records no weights identity (a run started by an older hsfarm): "
                        "the checkpoint cannot be checked against it; files written from now on "
                        "carry identity %s, and the canary guards the served model",
                        self.out_dir, outdir.MANIFEST, identity["id"])
        self.weights_id = str(identity["id"])

    def recorded_weights_id(self) -> str | None:
        """The weights identity the manifest records (None: none recorded, or no manifest)."""
        try:
            entry = manifests.recorded_weights(manifests.read(self.out_dir))
        except (OSError, ConfigError):
            return None
        return str(entry["id"]) if entry is not None and "id" in entry else None

    def _write_final_norm(self) -> dict[str, object]:
        """Store the model's final-norm weight beside the manifest; the manifest's entry.

        Not part of the fingerprint (a run's id does not change; manifests without it still
        open). A model whose final norm cannot be found still runs: the entry says why, and
        only the exports that need the weight refuse.
        """
        if self.model_path is None:
            return {"error": "not recorded (no model path given to the store)"}
        try:
            norm = final_norm.read_final_norm(self.model_path, self.fingerprint.hidden_size)
        except (ConfigError, OSError, ValueError, KeyError) as e:
            log.warning("final norm weight not recorded: %s", e)
            return {"error": str(e)}
        weight = np.ascontiguousarray(norm.weight.array)
        sums = {final_norm.TENSOR: checksums.tensor_checksum(weight.data)}
        final_norm.write_final_norm(self.out_dir, norm, checksums.checksum_metadata(sums))
        return {"file": outdir.FINAL_NORM_FILE, "tensor": final_norm.TENSOR,
                "source_tensor": norm.source_name, "dtype": norm.weight.dtype,
                "rms_norm_eps": norm.rms_norm_eps,
                checksums.M_ALGORITHM: checksums.DEFAULT_ALGORITHM, checksums.M_CHECKSUMS: sums}

    def final_path(self, key: str) -> Path:
        return outdir.final_path(self.out_dir, key)

    def write(self, key: str, parts: dict[str, Part], metadata: dict[str, str],
              validate: Callable[[], None] | None = None) -> Path:
        """``write_verified``'s final path (the file was read back and checked before it)."""
        return self.write_verified(key, parts, metadata, validate).path

    def write_verified(self, key: str, parts: dict[str, Part], metadata: dict[str, str],
                       validate: Callable[[], None] | None = None) -> Verified:
        """Write a final file durably and atomically, read back from the device (``verify``) before
        its rename; ``validate`` runs once every byte passed the parts' checks. The caller holds
        the sample's lease (an attempt, ``adopt``), so other temp files of the sample are writers'
        without it: removed first (``_remove_other_temps``).

        Raises: NoSpace (ENOSPC/EDQUOT); OutputUnavailable (any other I/O error); Corrupt (not
        this run's layout, from ``validate``, or not read back whole: nothing is left); LeaseLost
        (the temp file was removed before its rename, by the attempt that holds the lease now)."""
        final = self.final_path(key)
        layout = {name: (p.dtype, p.shape) for name, p in parts.items()}
        problems = finalfile.layout_problems(self.fingerprint, layout,
                                             layout.get(T_INPUT_IDS, ("", (-1,)))[1])
        if problems:
            raise Corrupt(f"{final}: not this run's layout: " + "; ".join(problems))
        tmp = outdir.temp_path(final)
        meta = {**metadata, finalfile.M_KEY: key, finalfile.M_FINGERPRINT: self.fingerprint.id}
        with io_errors(f"writing {final}", sum(p.nbytes for p in parts.values())):
            final.parent.mkdir(parents=True, exist_ok=True)
            self._remove_other_temps(final)
            try:
                self._write_tmp(tmp, parts, meta, validate)
                try:
                    v = self._read_back(tmp, key, metadata.get(finalfile.M_CONTENT), final)
                    diskio.drop_cache(tmp)  # what the read-back cached: RAM stays free
                    durable.commit_synced(tmp, final)
                except FileNotFoundError as e:
                    if not final.parent.is_dir():
                        raise  # the directory went: the disk's fault (OutputUnavailable)
                    raise LeaseLost(f"{tmp.name} was removed before its rename: another "
                                    f"attempt of {key} holds its lease now") from e
            finally:
                with contextlib.suppress(OSError):  # gone, or the disk refuses: a dead
                    tmp.unlink()                    # writer's temp, removed later
        return Verified(final, v.tokens, v.size_bytes, v.file)

    def _write_tmp(self, tmp: Path, parts: dict[str, Part], meta: dict[str, str],
                   validate: Callable[[], None] | None) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            write_parts(fd, parts, meta, validate)
            if self.debug_write_delay_s:
                time.sleep(self.debug_write_delay_s)
            os.fsync(fd)
            os.fchmod(fd, 0o644)
            diskio.drop_cache(fd)  # so that verification reads the device, and RAM stays free
        finally:
            os.close(fd)

    def verify(self, key: str, content_sha256: str | None = None) -> Verified:
        """Read the final file back from the disk (not the page cache) and check it completely.

        Raises:
            Corrupt: missing tensors, wrong dtypes/shapes, checksum or fingerprint mismatch.
            FileNotFoundError: there is no final file.
        """
        return self._read_back(self.final_path(key), key, content_sha256)

    def _read_back(self, path: Path, key: str, content_sha256: str | None,
                   shown: Path | None = None) -> Verified:
        """``verify``'s checks of the file at ``path`` (named ``shown`` in a refusal)."""
        header, sums, small = read_back(path, small=finalfile.SMALL)
        meta = header.metadata
        problems = finalfile.identity_problems(meta, key, self.fingerprint, content_sha256)
        problems += finalfile.shape_problems(self.fingerprint, header)
        problems += _checksum_problems(meta, sums)
        problems += [f"{name} has {n} scales that are not finite and > 0"
                     for name in finalfile.SCALES
                     if name in small and (n := fp8.bad_scales(small[name].array))]
        if problems:
            raise Corrupt(f"{shown or path}: " + "; ".join(problems))
        tf = tensorfile.TensorFile(small, meta, header.size_bytes)
        return Verified(path, int(header.tensors[T_INPUT_IDS].shape[0]), header.size_bytes, tf)

    def header_problems(self, header: tensorfile.Header) -> list[str]:
        """How a final file's header differs from this run's (``finalfile.header_problems``)."""
        return finalfile.header_problems(self.fingerprint, header)

    @staticmethod
    def _remove_other_temps(final: Path) -> None:
        """Every other temp file of this sample: its writer no longer holds the lease we hold.

        Either it is gone: killed mid-write, here or where our /proc cannot tell (another pid
        namespace, another host on a shared output dir; a temp file of 86-470 MB otherwise
        left until a worker's start-up removes it by age). Or it is alive and lost the lease
        (it stopped renewing for a whole TTL): without its temp file its rename fails and it
        writes nothing (``LeaseLost`` above), instead of replacing our file after us.
        """
        for p in final.parent.glob(f".{final.name}{outdir.TMP_MARK}*"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                log.info("removed %s: its writer no longer holds the sample's lease", p.name)

    def clean_stale_temp(self, max_age_s: float) -> int:
        """Remove temp files left by crashed writers; never touch finished files.

        A temp file is stale when its writer (a process of this machine) is no longer alive,
        or it is older than ``max_age_s`` (writers on other machines sharing the directory).
        """
        removed = 0
        for p in self.out_dir.rglob(f".*{outdir.TMP_MARK}*"):
            try:
                if outdir.temp_writer_dead(p.name) or time.time() - p.stat().st_mtime > max_age_s:
                    p.unlink()
                    removed += 1
            except OSError:
                continue
        if removed:
            log.info("removed %d stale temp files under %s", removed, self.out_dir)
        return removed


@contextmanager
def io_errors(what: str, need_bytes: int) -> Iterator[None]:
    """The output disk's one boundary for I/O errors: no space → NoSpace, the rest (read-only,
    EIO, a stale NFS handle, permissions) → OutputUnavailable: the disk's fault, never the
    sample's, so neither spends an attempt."""
    try:
        yield
    except OSError as e:
        if diskio.is_no_space(e):
            raise NoSpace(f"{what}: {e.strerror}", need_bytes=need_bytes) from e
        raise OutputUnavailable(f"{what}: {e}") from e


def writable_problem(out_dir: Path) -> str | None:
    """None when a file can be created, written, synced and removed under ``out_dir``."""
    probe = out_dir / outdir.SAMPLES_DIR / f".probe{outdir.TMP_MARK}{outdir.temp_tag()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"\0")
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                probe.unlink()
    except OSError as e:
        if diskio.is_no_space(e):
            return None  # writable; the space checks wait for room
        return f"the output dir {out_dir} cannot be written ({e.strerror or e})"
    return None


def _checksum_problems(meta: dict[str, str], got: dict[str, str]) -> list[str]:
    """Compare the digests read back (with the metadata's algorithm) with the metadata's."""
    _, recorded = checksums.file_checksums(meta)
    return [f"checksum of {name}" for name in sorted(got) if recorded.get(name) != got[name]]
