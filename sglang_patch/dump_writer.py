"""Model-agnostic dump writer: assemble per-request rows across forward passes, write files.

Used unchanged by the SGLang plugin and by the reference server. The caller hands over one
forward pass at a time as a flattened batch (rows of all requests, in request order) with the
request ids and per-request prefix/extend lengths, exactly as SGLang's ForwardBatch carries
them. Only rids that parse as ours (``contracts.parse_rid``) are kept; everything else
(health checks, warm-up, other clients) is ignored without a copy.

Why the staging seam: on a GPU the copy must stay off the critical path, so a ``Stager``
starts an asynchronous device-to-host copy and returns at once; the writer thread waits for
it. On CPU the stager is a plain clone.

Storage dtype: with ``dtype`` fp8_e4m3 (``contracts.DTYPE_FP8``) each chunk's rows are
quantized (``fp8.quantize``, a scale per token per layer) by the stager's ``encode`` before the
copy: on a GPU on the copy's side stream, so the forward's stream does not wait for it and the
device-to-host copy, tmpfs and the worker carry half the bytes. The farm's own requests
(``contracts.dump_dtype_for``: the canary) stay bf16.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from sglang_patch import contracts as c
from sglang_patch import dumpdir, fp8, markers

log = logging.getLogger("hsfarm.dump")


class Staged(Protocol):
    def wait(self) -> list[torch.Tensor]: ...


Encode = Callable[[list[torch.Tensor]], list[torch.Tensor]]


class Stager(Protocol):
    """Starts copying device tensors to host memory; ``wait`` on the result gives CPU tensors.

    ``encode``, when given, turns the tensors into the ones to copy (the fp8 quantization); it
    runs where the copy is issued (a GPU stager: on its side stream)."""

    def stage(self, tensors: list[torch.Tensor], encode: Encode | None = None) -> Staged: ...


def encode_fp8(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[ids, hidden, aux] -> [ids, hidden fp8, hidden scales, aux fp8, aux scales]."""
    ids, hidden, aux = tensors
    hq, hs = fp8.quantize(hidden, 1)
    aq, as_ = fp8.quantize(aux, c.AUX_LAYERS)
    return [ids, hq, hs, aq, as_]


@dataclass
class _Done:
    tensors: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        return self.tensors


class CpuStager:
    """Synchronous copy (clone) for CPU tensors: the reference server and tests."""

    def stage(self, tensors: list[torch.Tensor], encode: Encode | None = None) -> Staged:
        if encode is not None:
            return _Done([t.detach().to("cpu", copy=True) for t in encode(tensors)])
        return _Done([t.detach().to("cpu", copy=True) for t in tensors])


@dataclass
class _Pending:
    n: int
    next_pos: int = 0
    parts: list[Staged] = field(default_factory=list)
    updated_s: float = 0.0


@dataclass
class DumpJob:
    """A finished request (parts staged) or a failure message, for the writer thread."""

    rid: str
    parts: list[Staged] | None = None
    error: str | None = None
    token_count: int = 0
    dtype: str = c.DTYPE_BF16


class DumpWriter:
    """One background thread writing ``<rid>.safetensors`` / ``<rid>.err`` atomically.

    The queue is bounded: when the disk (tmpfs) is slower than the model, ``submit`` blocks
    the caller instead of letting host memory grow without limit.
    """

    def __init__(
        self,
        dump_dir: Path,
        metadata: dict[str, str],
        max_queue: int = 8,
        min_free_bytes: int = 64 << 20,
        dtype: str = c.DTYPE_BF16,
    ) -> None:
        if dtype not in c.STORE_DTYPES:
            raise ValueError(f"unknown dump dtype {dtype!r}: one of {', '.join(c.STORE_DTYPES)}")
        self.dtype = dtype  # what the collector dumps our requests in
        self.dump_dir = dump_dir
        self.metadata = dict(metadata)
        self.min_free_bytes = min_free_bytes
        self._q: queue.Queue[DumpJob | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="hsfarm-dump-writer", daemon=True)
        self.written = 0
        self.errors = 0
        self.blocked_s = 0.0  # time callers spent waiting on a full queue (backpressure)
        self.max_depth = 0
        dumpdir.ensure(dump_dir)  # refuses a dir another user owns or can write to
        self._thread.start()

    def submit(self, job: DumpJob) -> None:
        """Queue a job; blocks while the queue is full (backpressure, by design)."""
        if self._q.full():
            t0 = time.perf_counter()
            self._q.put(job)
            self.blocked_s += time.perf_counter() - t0
        else:
            self._q.put(job)
        self.max_depth = max(self.max_depth, self._q.qsize())

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until every submitted job is on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception as e:  # the writer must never die: report and go on
                log.exception("dump writer failed for %s", job.rid if job else "?")
                if job is not None:
                    self._write_err(job.rid, f"writer failed: {type(e).__name__}: {e}")
            finally:
                self._q.task_done()

    def _write(self, job: DumpJob) -> None:
        if job.error is not None or job.parts is None:
            self._write_err(job.rid, job.error or "no data")
            return
        chunks = [p.wait() for p in job.parts]
        tensors = _assemble(chunks, job.dtype)
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        free = free_bytes(self.dump_dir)
        if free - need < self.min_free_bytes:
            self._write_err(
                job.rid,
                f"{c.ERR_DUMP_DIR_FULL}: {free} bytes free, need {need} + reserve "
                f"{self.min_free_bytes}",
            )
            return
        meta = {**self.metadata, c.M_RID: job.rid, c.M_DUMP_DTYPE: job.dtype}
        final = c.dump_path(self.dump_dir, job.rid)
        tmp = self.dump_dir / f".{job.rid}{c.TMP_MARK}{os.getpid()}"
        try:
            self._save(job.rid, tensors, tmp, meta)
            dumpdir.seal(tmp)  # 0600 (0640 in a group dir) whatever the umask
            os.replace(tmp, final)
        except Exception as e:  # safetensors raises SafetensorError, not OSError, on ENOSPC
            if not _no_space(e):
                raise
            self._write_err(job.rid, f"{c.ERR_DUMP_DIR_FULL}: {type(e).__name__}: {e}")
            return
        finally:
            tmp.unlink(missing_ok=True)
        self.written += 1

    def _save(self, rid: str, tensors: dict[str, torch.Tensor], path: Path,
              metadata: dict[str, str]) -> None:
        """Serialise one dump to ``path`` (a temp file; the caller renames it into place)."""
        save_file(tensors, str(path), metadata=metadata)

    def _write_err(self, rid: str, message: str) -> None:
        self.errors += 1
        write_err(self.dump_dir, rid, message)


class DumpCollector:
    """Assembles each of our requests from its chunks and hands it to the writer when whole.

    Detects, and reports as ``<rid>.err`` (never a silently short file):
    - a gap: a chunk whose prefix is not where the previous chunk ended (also what a radix-cache
      hit looks like: the first chunk arrives with a non-zero prefix);
    - truncation/overrun: more tokens than the rid declares;
    - abandonment: no chunk for ``ttl_s`` (aborted requests; the state is dropped).

    Rows past the prompt the rid declares are tokens generated after it (a decoding request
    of ours inside a ``--enable-mixed-chunk`` batch): not prompt rows, so they are skipped.
    """

    def __init__(
        self,
        writer: DumpWriter,
        stager: Stager | None = None,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.writer = writer
        self.stager: Stager = stager or CpuStager()
        self.ttl_s = ttl_s
        self.clock = clock
        self._pending: dict[str, _Pending] = {}
        self._last_sweep_s = clock()

    def on_forward(
        self,
        rids: Sequence[str],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: torch.Tensor,
    ) -> None:
        """Take one forward pass's rows. Padding rows after the last request are ignored."""
        now = self.clock()
        n_req = len(rids)
        rows = sum(int(x) for x in extend_lens[:n_req])
        if hidden.shape[0] < rows or aux.shape[0] < rows or input_ids.shape[0] < rows:
            raise ValueError(
                f"batch layout: {rows} rows expected, got ids {input_ids.shape[0]}, "
                f"hidden {hidden.shape[0]}, aux {aux.shape[0]}"
            )
        offset = 0
        for i in range(n_req):
            ext, prefix = int(extend_lens[i]), int(prefix_lens[i])
            start, offset = offset, offset + ext
            rid = c.parse_rid(rids[i])
            if rid is None or ext == 0:
                continue
            self._take_chunk(rids[i], rid, prefix, ext, now, input_ids, hidden, aux, start)
        if now - self._last_sweep_s > min(self.ttl_s, 30.0):
            self.sweep(now)

    def _take_chunk(
        self,
        rid_s: str,
        rid: c.Rid,
        prefix: int,
        ext: int,
        now: float,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: torch.Tensor,
        start: int,
    ) -> None:
        if prefix >= rid.token_count:
            return  # a token generated after the prompt (a decode row of a mixed batch)
        state = self._pending.get(rid_s)
        if prefix == 0:
            state = self._pending[rid_s] = _Pending(n=rid.token_count)
        elif state is None or state.next_pos != prefix:
            self._pending.pop(rid_s, None)
            have = ("no earlier chunk" if state is None
                    else f"earlier chunks end at {state.next_pos}")
            self._fail(rid_s, f"gap: chunk starts at {prefix}, {have} (prefix-cache hit?)")
            return
        end = prefix + ext
        if end > state.n:
            self._pending.pop(rid_s, None)
            self._fail(rid_s, f"overrun: {end} tokens seen, rid declares {state.n}")
            return
        sl = slice(start, start + ext)
        dtype = c.dump_dtype_for(rid, self.writer.dtype)
        encode = encode_fp8 if dtype == c.DTYPE_FP8 else None
        state.parts.append(self.stager.stage([ids[sl], hidden[sl], aux[sl]], encode))
        state.next_pos, state.updated_s = end, now
        if end == state.n:
            del self._pending[rid_s]
            self.writer.submit(DumpJob(rid_s, parts=state.parts, token_count=state.n,
                                       dtype=dtype))

    def _fail(self, rid: str, message: str) -> None:
        self.writer.submit(DumpJob(rid, error=message))

    def sweep(self, now: float | None = None) -> int:
        """Drop requests with no chunk for ``ttl_s``; write their ``.err``. Returns how many."""
        now = self.clock() if now is None else now
        self._last_sweep_s = now
        stale = [r for r, s in self._pending.items() if now - s.updated_s > self.ttl_s]
        for rid in stale:
            s = self._pending.pop(rid)
            self._fail(rid, f"incomplete: {s.next_pos} of {s.n} tokens, no chunk for {self.ttl_s}s")
        return len(stale)

    @property
    def pending(self) -> int:
        return len(self._pending)


def _assemble(chunks: list[list[torch.Tensor]], dtype: str) -> dict[str, torch.Tensor]:
    """One request's tensors, by name, from its staged chunks (in the dump's dtypes)."""
    if dtype == c.DTYPE_FP8:
        ids, hq, hs, aq, as_ = (_join([ch[i] for ch in chunks], dt) for i, dt in
                                ((0, torch.int64), (1, torch.uint8), (2, torch.float32),
                                 (3, torch.uint8), (4, torch.float32)))
        return {c.T_INPUT_IDS: ids, c.T_HIDDEN: hq.view(fp8.FP8), c.T_HIDDEN_SCALE: hs,
                c.T_AUX: aq.view(fp8.FP8), c.T_AUX_SCALE: as_}
    ids, hidden, aux = (_join([ch[i] for ch in chunks], dt) for i, dt in
                        ((0, torch.int64), (1, torch.bfloat16), (2, torch.bfloat16)))
    return {c.T_INPUT_IDS: ids, c.T_HIDDEN: hidden, c.T_AUX: aux}


def _join(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Concatenate chunks (no copy for a single chunk already in ``dtype``)."""
    t = parts[0] if len(parts) == 1 else torch.cat(parts)
    return t.to(dtype).contiguous()


def _no_space(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return "No space left on device" in str(e) or "Disk quota exceeded" in str(e)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def write_err(dump_dir: Path, rid: str, message: str) -> None:
    """Write ``<rid>.err`` atomically: the request of ours that cannot have a dump, and why."""
    log.warning("dump error %s: %s", rid, message)
    tmp = dump_dir / f".{rid}{c.TMP_MARK}{os.getpid()}.err"
    try:
        dumpdir.write_private(tmp, (message + "\n").encode())
        os.replace(tmp, c.err_path(dump_dir, rid))
    except OSError:
        log.exception("cannot even write the .err file for %s", rid)
        tmp.unlink(missing_ok=True)


def remove_stale_files(dump_dir: Path) -> int:
    """Remove the temp files and ready markers of hook processes that no longer exist.

    What a server killed mid-write leaves in tmpfs (RAM): its half-written ``.<rid>.tmp.<pid>``
    files and its ``.ready.<pid>`` marker. Files of living processes are never touched, nor
    anything that is not a temp file or marker of ours, nor a marker whose writer cannot be
    judged from here (``markers``: another pid namespace or boot). Returns how many were
    removed.
    """
    removed = len(markers.remove_dead(dump_dir))
    for path in dump_dir.iterdir():
        pid = _writer_pid(path.name) if c.is_temp_name(path.name) else None
        if pid is not None and not _process_exists(pid):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _writer_pid(name: str) -> int | None:
    """The pid in a ready marker's or a hook temp file's name; None for any other file."""
    if name.startswith(c.READY_PREFIX):
        field = name[len(c.READY_PREFIX):]
    elif name.startswith(".") and c.is_temp_name(name):
        field = name.split(c.TMP_MARK, 1)[1]
    else:
        return None
    digits = field.split(".", 1)[0]
    return int(digits) if digits.isdigit() else None


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
