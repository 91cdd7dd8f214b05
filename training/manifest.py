"""The run's manifest and final-norm weight, as a trainer's machine reads them.

Every sample file is checked against the manifest: its fingerprint id, and its tensors'
dtypes and shapes (T >= 2, [T, H], [T, 3H]; fp8 runs: e4m3 and their scales [T, 1], [T, 3]).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_dump.dumpfile import DTYPE_FP8, T_INPUT_IDS
from engine_dump.fingerprint import Fingerprint
from training.sample_file import SampleFile
from worker.core import checksums, final_norm, outdir
from worker.core import manifest as manifests
from worker.core.errors import ConfigError, Corrupt
from worker.core.finalfile import M_FINGERPRINT, M_KEY, final_layout


@dataclass(frozen=True)
class RunInfo:
    """One output directory's manifest, read and checked."""

    out_dir: Path
    fingerprint: Fingerprint
    manifest: dict[str, Any]

    @property
    def hidden_size(self) -> int:
        return self.fingerprint.hidden_size

    @property
    def fp8(self) -> bool:
        """The run stores its hidden states as float8 e4m3 with scales (``training.fp8``)."""
        return self.fingerprint.dtype == DTYPE_FP8

    def check_sample(self, sf: SampleFile, key: str | None = None) -> None:
        """Raises Corrupt when a file is not a whole sample of this run (header only)."""
        problems = []
        if sf.metadata.get(M_FINGERPRINT) != self.fingerprint.id:
            problems.append(f"fingerprint {sf.metadata.get(M_FINGERPRINT)!r} is not this "
                            f"run's {self.fingerprint.id}")
        if key is not None and sf.metadata.get(M_KEY) != key:
            problems.append(f"sample_key {sf.metadata.get(M_KEY)!r} != {key!r}")
        ids = sf.entries.get(T_INPUT_IDS)
        t = ids.shape[0] if ids is not None and ids.shape else 0
        want = final_layout(self.fingerprint, t, {k: e.shape for k, e in sf.entries.items()})
        missing = set(want) - set(sf.entries)
        if missing:
            raise Corrupt(f"{sf.path}: missing tensors {sorted(missing)}")
        problems += [f"{k} is {sf.entries[k].dtype}{list(sf.entries[k].shape)}, expected "
                     f"{d}{list(s)}" for k, (d, s) in want.items()
                     if sf.entries[k].shape != s or sf.entries[k].dtype != d]
        if t < 2:
            problems.append(f"{t} tokens: trainers need at least 2")
        if problems:
            raise Corrupt(f"{sf.path}: " + "; ".join(problems))

    def final_norm(self) -> final_norm.FinalNorm:
        """The model's final-norm weight, checked against the manifest and the fingerprint.

        Raises:
            ConfigError: the run did not record it (the manifest says why), or it does not
                belong to this run's model.
        """
        entry = self.manifest.get("final_norm") or {}
        path = self.out_dir / outdir.FINAL_NORM_FILE
        if not path.exists():
            why = entry.get("error", "the manifest predates it")
            raise ConfigError(f"{path} is missing ({why}); the pre-norm state cannot be derived")
        norm = final_norm.load_final_norm(self.out_dir)
        want = (checksums.Recorded.from_json(entry) if entry.get("checksums")
                else checksums.recorded(SampleFile.open(path).metadata))
        if checksums.mismatches(want, {final_norm.TENSOR: norm.weight.array}):
            raise ConfigError(f"{path}: checksum differs from the one recorded")
        if norm.config_sha256 != self.fingerprint.config_sha256:
            raise ConfigError(f"{path} was read from another model (config hash differs)")
        return norm


def load_run_info(out_dir: Path) -> RunInfo:
    """Read ``<out>/manifest.json``. Raises ConfigError with what is wrong."""
    path = manifests.path(out_dir)
    try:
        manifest = manifests.read(out_dir)
    except FileNotFoundError:
        raise ConfigError(f"{out_dir} is not an hsfarm output dir: no {outdir.MANIFEST}") from None
    fp = manifests.fingerprint(manifest, path)
    recorded_id = manifest.get(manifests.M_FINGERPRINT_ID)
    if recorded_id != fp.id:
        raise ConfigError(f"{path}: fingerprint_id {recorded_id} does not match its "
                          f"fingerprint ({fp.id})")
    return RunInfo(out_dir, fp, manifest)
