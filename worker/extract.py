"""One sample, start to finish: read → tokenize → request → collect → validate → write → verify.

Pure orchestration over the runtime's parts; the Celery task (tasks.py) maps its errors to
retry / reject / fail. Every step that can fail raises one of the farm's errors.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sglang_patch import contracts as c
from worker import store as st
from worker import tensorfile
from worker.dumps import discard_dumps, load_dump, wait_for_dump
from worker.errors import Corrupt, KeyTaken
from worker.lease import Lease
from worker.runtime import Runtime
from worker.samples import SampleRef, read_sample

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
    if meta.get(st.M_FINGERPRINT) != rt.fingerprint.id:
        raise KeyTaken(f"{path} holds a file of another run (fingerprint "
                       f"{str(meta.get(st.M_FINGERPRINT))[:20]!r}); move it away, then "
                       "run enqueue --retry-failed")
    if meta.get(st.M_CONTENT) != ref.sha256:
        if meta.get(st.M_SOURCE_FILE) == ref.file:
            log.info("%s the record was edited since its file was written; redoing it", ref.key)
            return None
        raise KeyTaken(
            f"sample key {ref.key!r} already holds another record (source id "
            f"{str(meta.get(st.M_SOURCE_ID))[:80]}, from {meta.get(st.M_SOURCE_FILE, '?')}); "
            "keys must be unique within a run: give the records distinct ids")
    try:
        v = rt.store.verify(ref.key, ref.sha256)
    except Corrupt as e:
        log.warning("%s existing final file is damaged; this attempt replaces it: %s", ref.key, e)
        return None
    discard_dumps(rt.settings.dump_dir, ref.key)
    rt.index.mark_done(ref.key, v.size_bytes, v.tokens)
    return Result("already-done", v.tokens, v.size_bytes)


def check_space(rt: Runtime) -> None:
    """Raises Transient when the output disk or the dump dir is below its reserve."""
    rt.store.check_space()
    st.check_free(rt.settings.dump_dir, rt.settings.min_free_dump_bytes, "dump dir")


def extract(rt: Runtime, ref: SampleRef, attempt: int, lease: Lease, try_no: int) -> Result:
    """Raises BadInput, StaleRecord, Transient or Corrupt.

    Args:
        attempt: the counted attempt (for the logs); ``try_no`` numbers the request's rid.
        lease: this sample's lease, held by the caller.
    """
    t0 = time.monotonic()
    sample, ref = read_sample(ref)
    tok = rt.chat.encode(sample)
    n = len(tok.input_ids)
    rid = c.make_rid(ref.key, try_no, n)
    discard_dumps(rt.settings.dump_dir, ref.key)
    log.info("%s a%d tokenized n=%d%s", ref.key, attempt, n,
             f" (truncated from {tok.truncated_from})" if tok.truncated_from else "")
    dump = rt.loop.run_until_complete(_request(rt, rid, tok.input_ids))
    try:
        log.info("%s a%d dump received +%.2fs", ref.key, attempt, time.monotonic() - t0)
        tf = load_dump(dump, tok.input_ids, rt.fingerprint)
        tensors = {
            c.T_INPUT_IDS: tf.tensors[c.T_INPUT_IDS],
            c.T_LOSS_MASK: tensorfile.Tensor("I64", np.asarray(tok.loss_mask, dtype=np.int64)),
            c.T_HIDDEN: tf.tensors[c.T_HIDDEN],
            c.T_AUX: tf.tensors[c.T_AUX],
        }
        meta = {
            st.M_SOURCE_ID: json.dumps(sample.source_id),
            st.M_SOURCE_FILE: ref.file,
            st.M_CONTENT: ref.sha256,
            st.M_TRUNCATED: str(tok.truncated_from),
            c.M_LAYERS: json.dumps(list(rt.fingerprint.layers_to_capture)),
            c.M_PATCH_VERSION: tf.metadata.get(c.M_PATCH_VERSION, ""),
            c.M_SERVER_VERSION: tf.metadata.get(c.M_SERVER_VERSION, ""),
        }
        lease.check()  # another attempt owns the sample now: write nothing
        rt.store.write(ref.key, tensors, meta)
        v = rt.store.verify(ref.key, ref.sha256)  # a bad file is replaced by the next attempt
    finally:
        dump.unlink(missing_ok=True)
    rt.index.mark_done(ref.key, v.size_bytes, v.tokens)
    log.info("%s a%d done n=%d bytes=%d +%.2fs", ref.key, attempt, v.tokens, v.size_bytes,
             time.monotonic() - t0)
    return Result("done", v.tokens, v.size_bytes)


async def _request(rt: Runtime, rid: str, ids: list[int]) -> Path:
    await rt.client.generate(rid, ids)
    return await wait_for_dump(rt.settings.dump_dir, rid, rt.settings.dump_timeout_s)
