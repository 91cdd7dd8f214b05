"""One sample, start to finish: read → (regenerate) → tokenize → request → collect → validate →
write → verify.

Pure orchestration over the runtime's parts; the Celery task (tasks.py) maps its errors to
retry / reject / fail. Every step that can fail raises one of the farm's errors.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine_dump.dumpfile import (
    M_LAYERS,
    M_PATCH_VERSION,
    M_SERVER_VERSION,
    T_INPUT_IDS,
    T_LOSS_MASK,
    hidden_layout,
)
from engine_dump.rids import make_rid
from worker.core import finalfile, tensorfile, time_limits
from worker.core import store as st
from worker.core.dumps import Dump, discard_dumps, open_dump, wait_for_dump
from worker.core.errors import Corrupt, KeyTaken
from worker.core.samples import SampleRef, read_sample
from worker.regen.step import regenerate
from worker.runtime import Runtime
from worker.state.hosts import holder
from worker.state.lease import Lease

log = logging.getLogger("hsfarm.extract")


@dataclass(frozen=True)
class Result:
    status: str  # "done" | "already-done"
    tokens: int
    size_bytes: int


def already_done(rt: Runtime, ref: SampleRef) -> Result | None:
    """A redelivered or re-enqueued sample whose final file verifies needs no work.

    Never deletes a file. A damaged file of this sample (it fails its checks) is left for the
    attempt to replace atomically; a file of another run, or of another record under the
    same key, is never touched.

    Raises:
        KeyTaken: the key's file belongs to another run or holds another record.
    """
    path = rt.store.final_path(ref.key)
    try:
        meta = tensorfile.header_metadata(path)
    except FileNotFoundError:
        return None
    except (Corrupt, OSError) as e:
        log.warning("%s existing final file is damaged; this attempt replaces it: %s", ref.key, e)
        return None
    if meta.get(finalfile.M_FINGERPRINT) != rt.fingerprint.id:
        raise KeyTaken(f"{path} holds a file of another run (fingerprint "
                       f"{str(meta.get(finalfile.M_FINGERPRINT))[:20]!r}); move it away, then "
                       "run enqueue --retry-failed")
    if meta.get(finalfile.M_CONTENT) != ref.sha256:
        if meta.get(finalfile.M_SOURCE_FILE) == ref.file:
            log.info("%s the record was edited since its file was written; redoing it", ref.key)
            return None
        raise KeyTaken(
            f"sample key {ref.key!r} already holds another record (source id "
            f"{str(meta.get(finalfile.M_SOURCE_ID))[:80]}, from "
            f"{meta.get(finalfile.M_SOURCE_FILE, '?')}); "
            "keys must be unique within a run: give the records distinct ids")
    written_under = meta.get(finalfile.M_WEIGHTS_ID)  # None: the file does not record it
    if written_under and rt.store.weights_id and written_under != rt.store.weights_id:
        log.warning("%s existing final file was written under weights identity %s, the run's "
                    "is %s; this attempt replaces it", ref.key, written_under,
                    rt.store.weights_id)
        return None
    try:
        v = rt.store.verify(ref.key, ref.sha256)
    except Corrupt as e:
        log.warning("%s existing final file is damaged; this attempt replaces it: %s", ref.key, e)
        return None
    discard_dumps(rt.settings.dump_dir, rt.run_id, ref.key)
    rt.index.mark_done(ref.key, v.size_bytes, v.tokens, rt.hostname, ref.sha256)
    return Result("already-done", v.tokens, v.size_bytes)


def done_elsewhere(rt: Runtime, ref: SampleRef) -> str | None:
    """The other host whose output dir holds this sample's final file, of this very record
    (a message returned after its host died between the write and the acknowledgement)."""
    held = holder(rt.index, ref.key)
    if held is None or held[0] == rt.hostname or held[1] != ref.sha256:
        return None
    return held[0] if rt.index.are_done([ref.key])[0] else None


def extract(rt: Runtime, ref: SampleRef, attempt: int, lease: Lease, try_no: int,
            deadline: float, budget_s: float) -> Result:
    """Raises BadInput, StaleRecord, Transient or Corrupt; a regenerating run's turns also
    ``OutOfTime`` (worker/regen/step.py).

    Args:
        attempt: the counted attempt (for the logs); ``try_no`` numbers the request's rid.
        lease: this sample's lease, held by the caller.
        deadline, budget_s: this delivery's (``time.monotonic``), and all of its time.
    """
    t0 = time.monotonic()
    sample, ref = read_sample(ref, prompts=rt.generation is not None)
    generated = None
    if rt.generation is not None:
        sample, generated = regenerate(rt, ref, sample, lease, deadline, budget_s, try_no)
    tok = rt.chat.encode(sample)
    n = len(tok.input_ids)
    rid = make_rid(ref.key, try_no, n, run=rt.run_id)
    discard_dumps(rt.settings.dump_dir, rt.run_id, ref.key)
    log.info("%s a%d tokenized n=%d%s", ref.key, attempt, n,
             f" (truncated from {tok.truncated_from})" if tok.truncated_from else "")
    prove = rt.prover is not None and rt.prover.wanted(ref.key)
    with rt.admission.admit(n) as ticket:  # a request place, and tmpfs room for the dump
        dump_wait_s = rt.settings.dump_timeout_s + time_limits.io_s(
            rt.settings, ticket.holding.dump_bytes)  # a long sample's dump takes longer
        answer, dump = rt.loop.run_until_complete(
            _request(rt, rid, tok.input_ids, ticket.dp_rank, dump_wait_s, prove))
        ticket.answered()
        try:
            log.info("%s a%d dump received +%.2fs", ref.key, attempt, time.monotonic() - t0)
            meta = {
                finalfile.M_SOURCE_ID: json.dumps(sample.source_id),
                finalfile.M_SOURCE_FILE: ref.file,
                finalfile.M_TRUNCATED: str(tok.truncated_from),
                M_LAYERS: json.dumps(list(rt.fingerprint.layers_to_capture)),
                finalfile.M_WEIGHTS_ID: rt.store.weights_id,
            }
            if generated is not None:  # the conversation these states are of, and its turns
                meta[finalfile.M_MESSAGES] = json.dumps(list(sample.messages))
                meta[finalfile.M_GENERATION] = generated.metadata()
            v = store_dump(rt.store, dump, tok.input_ids, tok.loss_mask, ref.key, ref.sha256,
                           meta, before_write=lease.check,  # lost the lease: write nothing
                           prove=_prover(rt, answer, tok.input_ids, rid) if prove else None)
        finally:
            dump.unlink(missing_ok=True)
    rt.index.mark_done(ref.key, v.size_bytes, v.tokens, rt.hostname, ref.sha256)
    log.info("%s a%d done n=%d bytes=%d +%.2fs", ref.key, attempt, v.tokens, v.size_bytes,
             time.monotonic() - t0)
    return Result("done", v.tokens, v.size_bytes)


def store_dump(store: st.OutputStore, dump: Path, input_ids: list[int], loss_mask: list[int],
               key: str, content_sha256: str, meta: dict[str, str],
               before_write: Callable[[], None] | None = None,
               prove: Callable[[Dump], None] | None = None) -> st.Verified:
    """One sample's data path: validate the dump, write the final file, verify it from disk.

    ``meta`` is completed with the content hash and the dump's patch and server versions.
    ``before_write`` runs once the dump's layout, ids and metadata passed, just before the
    final file is written (the lease check); ``prove`` before it, with the open dump (the
    proof). The file is read back before its rename: one that
    fails verification never takes the final path. Raises Corrupt, NoSpace, OutputUnavailable
    or Transient.
    """
    with open_dump(dump, input_ids, store.fingerprint, store.served_weights_id) as d:
        parts = {
            T_INPUT_IDS: d.part(T_INPUT_IDS),
            T_LOSS_MASK: st.Part.from_array("I64", np.asarray(loss_mask, dtype=np.int64)),
            **{name: d.part(name) for name in hidden_layout(store.fingerprint.dtype, 0, 0)},
        }
        meta = {**meta, finalfile.M_CONTENT: content_sha256,
                M_PATCH_VERSION: d.metadata.get(M_PATCH_VERSION, ""),
                M_SERVER_VERSION: d.metadata.get(M_SERVER_VERSION, "")}
        if prove is not None:
            prove(d)
        if before_write is not None:
            before_write()
        return store.write_verified(key, parts, meta, validate=d.verdict)


async def _request(rt: Runtime, rid: str, ids: list[int], dp_rank: int | None,
                   dump_wait_s: float, prompt_logprobs: bool) -> tuple[dict[str, Any], Path]:
    answer = await rt.client.generate(rid, ids, dp_rank, prompt_logprobs)
    return answer, await wait_for_dump(rt.settings.dump_dir, rid, dump_wait_s)


def _prover(rt: Runtime, answer: dict[str, Any], ids: list[int],
            rid: str) -> Callable[[Dump], None]:
    """The proof of this sample's open dump against the server's answer (``sample_proof``)."""
    prover, engine = rt.prover, rt.loop.run_until_complete(rt.client.engine())
    assert prover is not None

    def prove(d: Dump) -> None:
        prover.check(engine.name, answer, ids, d.file.fileno(), d.header,
                     rt.fingerprint.dtype, rid)

    return prove
