"""``audit``: read every final file back from disk and check it against its source sample.

Per sample: the file parses, its tensors, dtypes, shapes and checksums are right, its
fingerprint, weights identity and content hash are this run's, and its input_ids and
loss_mask equal a fresh tokenization of the record (a regenerating run's: of the conversation
the file holds, checked against the record). It also names output files no record of
the corpus holds and counts those kept aside in ``<out>/removed/``.
Test: tests/farm/test_audit.py::test_audit_finds_and_requeue_repairs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engine_dump.dumpfile import DUMP_SUFFIX, T_INPUT_IDS, T_LOSS_MASK
from training.roots import sample_files
from worker.core import outdir, setaside, tensorfile
from worker.core.errors import BadInput, Corrupt, StaleRecord
from worker.core.finalfile import (
    M_ADOPTED_FROM,
    M_FINGERPRINT,
    M_MESSAGES,
    M_TRUNCATED,
    M_WEIGHTS_ID,
)
from worker.core.samples import Sample, SampleRef, read_sample, sample_refs
from worker.core.store import OutputStore
from worker.regen import record as generation
from worker.server.chat import ChatTokenizer, Tokenized
from worker.state import hosts, ledger
from worker.state.broker import Client

ADOPTED = "adopted"


@dataclass
class AuditReport:
    checked: int = 0
    whole: int = 0
    tokens: int = 0
    bytes: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: list[tuple[str, str]] = field(default_factory=list)
    incompatible: list[tuple[str, str]] = field(default_factory=list)
    invalid_records: int = 0  # records enqueue rejects too: not expected on disk
    adopted: int = 0  # whole files taken from an earlier run by ``adopt`` (their metadata)
    to_requeue: list[SampleRef] = field(default_factory=list)
    # host -> samples missing here that the run places on that host's output dir
    elsewhere: dict[str, int] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)  # every sample key of the data files checked
    not_in_corpus: list[str] | None = None  # None: not looked for (one data file of several)
    kept_aside: int = 0
    # this audit's fingerprint (settings and model files) != the run's manifest: field by field
    differences: list[str] = field(default_factory=list)
    # (data file, N): only its first N records are the run's (``enqueue --limit N``)
    limited: list[tuple[str, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.corrupt or self.incompatible or self.not_in_corpus)

    def add(self, other: AuditReport) -> None:
        """Fold another data file's report into this one."""
        for name in ("checked", "whole", "tokens", "bytes", "invalid_records", "adopted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("missing", "corrupt", "incompatible", "to_requeue", "limited"):
            getattr(self, name).extend(getattr(other, name))
        self.keys |= other.keys

    def look_beyond(self, out_dir: Path) -> None:
        """Name the output files no record of the data files checked holds, and count the
        files kept aside (call once every data file of the run is checked)."""
        self.not_in_corpus = sorted(
            key for p in sample_files(out_dir)
            if (key := p.name[: -len(DUMP_SUFFIX)]) not in self.keys)
        self.kept_aside = len(setaside.kept_aside(out_dir))

    def _why_incompatible(self) -> list[str]:
        if not self.incompatible or not self.differences:
            return []
        return ["  this audit's model differs from the run's (this audit != the run's "
                f"manifest): {'; '.join(self.differences)}; set FARM_MODEL_PATH to the "
                "run's model"]

    def lines(self, show: int = 50) -> list[str]:
        out = [f"checked: {self.checked}", f"whole: {self.whole} ({self.tokens} tokens, "
               f"{self.bytes / 1e6:.1f} MB)", f"missing: {len(self.missing)}",
               f"corrupt: {len(self.corrupt)}", f"incompatible: {len(self.incompatible)}",
               *self._why_incompatible(),
               f"invalid records (not expected on disk): {self.invalid_records}",
               f"adopted: {self.adopted}"]
        out += [f"limited: {path}: the first {n} records (enqueue --limit {n}); the rest are "
                "not in the run" for path, n in self.limited]
        if self.elsewhere:
            named = ", ".join(f"{h} {n}" for h, n in sorted(self.elsewhere.items()))
            out.append(f"on other hosts: {sum(self.elsewhere.values())} ({named}; "
                       "audit them there)")
        if self.not_in_corpus is not None:
            out += [f"not in the corpus: {len(self.not_in_corpus)} output files whose record "
                    "no data file holds (run enqueue on the edited data file to set them "
                    "aside)", f"kept aside: {self.kept_aside} output files of records removed "
                    f"from the corpus or corrected (in {outdir.REMOVED_DIR}/)"]
            out += [f"  not in the corpus {k}" for k in self.not_in_corpus[:show]]
        out += [f"  missing {k}" for k in self.missing[:show]]
        out += [f"  corrupt {k}: {why}" for k, why in self.corrupt[:show]]
        out += [f"  incompatible {k}: {why}" for k, why in self.incompatible[:show]]
        return out


def _check_one(store: OutputStore, chat: ChatTokenizer, ref: SampleRef,
               weights_id: str | None) -> tuple[str, str, int, int]:
    """(verdict, reason, tokens, bytes); verdict in whole/missing/corrupt/incompatible/invalid;
    the reason of a whole file is ``ADOPTED`` when ``adopt`` wrote it, else empty.

    "invalid": the record is one the worker rejects (too long, no assistant tokens, ...), so
    no file is expected for it.
    """
    regenerated = bool(store.fingerprint.generation)
    try:
        sample, _ = read_sample(ref, prompts=regenerated)
        if regenerated:  # the file's conversation is checked against the record below
            generation.needs_messages(sample.input_ids)
        else:
            tok = chat.encode(sample)
    except (BadInput, StaleRecord) as e:
        return "invalid", str(e), 0, 0
    path = store.final_path(ref.key)
    if not path.exists():
        return "missing", "", 0, 0
    try:
        meta = tensorfile.header_metadata(path)
        if regenerated:
            tok = _regenerated_tokens(chat, sample, meta)
        if meta.get(M_FINGERPRINT) != store.fingerprint.id:
            return "incompatible", (f"fingerprint {meta.get(M_FINGERPRINT)}, this audit's "
                                    f"{store.fingerprint.id}"), 0, 0
        written_under = meta.get(M_WEIGHTS_ID)  # files of older runs do not say: not judged
        if weights_id and written_under and written_under != weights_id:
            return "incompatible", (f"written under weights identity {written_under}, the "
                                    f"manifest records {weights_id}"), 0, 0
        v = store.verify(ref.key, ref.sha256)
    except (Corrupt, OSError) as e:
        return "corrupt", str(e), 0, 0
    ids, mask = v.file.tensors[T_INPUT_IDS].array, v.file.tensors[T_LOSS_MASK].array
    n = _cut_to_server(v.file.metadata, tok, len(ids))
    if not np.array_equal(ids, np.asarray(tok.input_ids[:n])):
        return "corrupt", "input_ids differ from a fresh tokenization of the record", 0, 0
    if not np.array_equal(mask, np.asarray(tok.loss_mask[:n])):
        return "corrupt", "loss_mask differs from a fresh tokenization of the record", 0, 0
    return "whole", ADOPTED if M_ADOPTED_FROM in v.file.metadata else "", v.tokens, v.size_bytes


def _regenerated_tokens(chat: ChatTokenizer, sample: Sample,
                        meta: dict[str, str]) -> Tokenized:
    """A regenerating run's file: the tokenization of the conversation it says its states are
    of, that conversation checked against the record (``generation.file_conversation``).

    Raises:
        Corrupt: the file's conversation is not the record's regenerated, or does not
            tokenize (the worker would not have written it).
    """
    try:
        conv = generation.file_conversation(meta.get(M_MESSAGES), sample.messages)
        return chat.encode(replace(sample, messages=tuple(conv)))
    except (ValueError, BadInput) as e:
        raise Corrupt(f"its regenerated conversation: {e}") from e


def _cut_to_server(meta: dict[str, str], tok: Tokenized, n: int) -> int:
    """How many tokens of the fresh tokenization the file should hold: all of them, or
    ``n`` when the worker cut the sample shorter, to what its server took (FARM_OVERLONG=
    truncate with a server context under FARM_MAX_TOKENS), and the file says from what."""
    whole = tok.truncated_from or len(tok.input_ids)
    if n < len(tok.input_ids) and meta.get(M_TRUNCATED) == str(whole):
        return n
    return len(tok.input_ids)


def audit(store: OutputStore, chat: ChatTokenizer, data_file: Path, max_record_bytes: int,
          jobs: int = 4, bar: tqdm | None = None, limit: int | None = None) -> AuditReport:
    """Check every sample of ``data_file``; sha256 and reads release the GIL, so threads help.

    ``bar``: a progress bar whose total grows by this file's samples, advanced per sample.
    ``limit``: only the first ``limit`` records are the run's (``enqueue_limits``).
    """
    report = AuditReport()
    if limit is not None:
        report.limited.append((str(data_file), limit))
    weights_id = store.recorded_weights_id()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rejected: list[tuple[str, str]] = []
        refs = list(sample_refs(data_file, max_record_bytes, rejected, [], limit=limit,
                                prompts=bool(store.fingerprint.generation)))
        report.invalid_records += len(rejected)
        if bar is not None:
            bar.total = (bar.total or 0) + len(refs)
            bar.refresh()
        results = pool.map(lambda ref: _check_one(store, chat, ref, weights_id),
                           refs)
        report.keys.update(ref.key for ref in refs)
        for ref, (verdict, why, tokens, size) in zip(refs, results, strict=True):
            report.checked += 1
            if bar is not None:
                bar.update(1)
            if verdict == "whole":
                report.whole += 1
                report.adopted += why == ADOPTED
                report.tokens += tokens
                report.bytes += size
                continue
            if verdict == "invalid":
                report.invalid_records += 1
                continue
            report.to_requeue.append(ref)
            if verdict == "missing":
                report.missing.append(ref.key)
            else:
                getattr(report, verdict).append((ref.key, why))
    return report


def enqueue_limits(out_dir: Path) -> dict[str, int]:
    """Data file path -> N, for the files the run enqueued with ``--limit N`` (its widest):
    what the output dir's ledger records (``worker.state.ledger``)."""
    return {e.path: e.limit for e in ledger.read(out_dir) if e.limit is not None}


def place_elsewhere(report: AuditReport, r: Client, run_id: str, host: str) -> None:
    """Samples missing here whose file the run places on another host's output dir (not a
    dir this host shares): counted per host, no longer missing, not requeued."""
    held = hosts.holders(r, run_id, report.missing)
    away = {k: by[0] for k, by in zip(report.missing, held, strict=True)
            if by is not None and by[0] != host and not hosts.same_output(r, run_id, by[0], host)}
    for other in away.values():
        report.elsewhere[other] = report.elsewhere.get(other, 0) + 1
    report.missing = [k for k in report.missing if k not in away]
    report.to_requeue = [ref for ref in report.to_requeue if ref.key not in away]
