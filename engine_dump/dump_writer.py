"""Model-agnostic dump writer: each request's rows, pass by pass, written into its dump file.

Used unchanged by the SGLang plugin and the reference server. The caller hands over one
forward pass at a time as SGLang's ForwardBatch carries it (flattened rows, rids, prefix and
extend lengths); rids that are not ours (``rids.parse_rid``) are ignored without a copy.
A ``Stager`` starts the device-to-host copy (and the fp8 ``encode``) and returns at once, so
on a GPU the copy stays off the forward's path; on CPU it is a plain clone.
Test: tests/unit/test_dump_writer.py::test_mixed_batches_with_chunks_spread_over_batches.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine_dump import dumpdir, fp8, header_codec, markers
from engine_dump.dumpfile import (
    AUX_LAYERS,
    DTYPE_BF16,
    DTYPE_FP8,
    ERR_DUMP_DIR_FULL,
    ERR_WRITER_UNHEALTHY,
    M_DUMP_DTYPE,
    M_RID,
    M_WRITER,
    READY_PREFIX,
    STORE_DTYPES,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    T_INPUT_IDS,
    TMP_MARK,
    WRITER_UNHEALTHY_PREFIX,
    dump_dtype_for,
    dump_path,
    err_path,
    is_temp_name,
)
from engine_dump.rids import Rid, parse_rid

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
    aq, as_ = fp8.quantize(aux, AUX_LAYERS)
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
class Rows:
    """One request's rows of one forward pass, staged: ``staged.wait()`` gives [ids, hidden,
    aux] (bf16 dumps) or [ids, hidden q, hidden scales, aux q, aux scales] (fp8)."""

    rid: str
    prefix: int
    token_count: int
    staged: Staged
    dtype: str = DTYPE_BF16


@dataclass
class Failed:
    """A request of ours that cannot have a dump, and why (its ``.err``)."""

    rid: str
    error: str


# What the writer thread is handed: the rows of ours of one forward pass, or one failure.
Job = list[Rows] | Failed


@dataclass
class _Open:
    """A dump being written: its temp file, where each tensor goes, bytes still to come."""

    fd: int
    tmp: Path
    ranges: dict[str, tuple[int, int]]  # tensor name -> absolute [begin, end) in the file
    meta: dict[str, str]
    n: int
    left: int


# ``submit`` runs in the engine's step (SGLang's forward, vLLM's ``get_finished``): while it
# blocks, every request of the server waits, and ``/health`` still says 200. So it waits for
# room only up to ``max_block_s`` (backpressure when tmpfs is slower than the model), and a
# writer whose thread is not running, or whose queue stayed full that long, is *unhealthy*: it
# refuses the rows it cannot take with an ``ERR_WRITER_UNHEALTHY`` ``.err`` (the worker pauses
# on it, spending no attempt: the server's fault, not the sample's), says so in the log and in
# a note beside its ready marker (``markers.write_unhealthy``: ``verify`` fails, workers pause),
# and is healthy again once its queue has drained. A dump refused is an attempt repeated
# later; a stalled step stalls every client. No job can end the thread: whatever it raises
# becomes its requests' ``.err``.


class DumpWriter:
    """One background thread writing ``<rid>.safetensors`` / ``<rid>.err`` atomically.

    A dump is written as its chunks arrive into a temp file of the whole dump's size (the rid
    declares the token count), renamed at the last chunk, so the server holds at most the
    queued passes (a bounded queue; ``submit`` waits a bounded time, then refuses: above): a
    128k-token prompt at H = 7,168 is a 7.5 GB dump it never holds whole. Tests:
    tests/unit/test_dump_writer.py::test_a_dump_is_written_as_its_chunks_arrive_with_the_librarys_bytes
    and ::test_a_stuck_writer_refuses_after_a_bounded_wait_and_recovers.
    """

    def __init__(
        self,
        dump_dir: Path,
        metadata: dict[str, str],
        max_queue: int = 8,
        min_free_bytes: int = 64 << 20,
        dtype: str = DTYPE_BF16,
        max_block_s: float = 30.0,
    ) -> None:
        if dtype not in STORE_DTYPES:
            raise ValueError(f"unknown dump dtype {dtype!r}: one of {', '.join(STORE_DTYPES)}")
        self.dtype = dtype  # what the collector dumps our requests in
        self.dump_dir = dump_dir
        # built in the process that writes the ready marker: every dump names it
        self.metadata = {**metadata, M_WRITER: markers.writer_id()}
        self.min_free_bytes = min_free_bytes
        self.max_queue = max_queue
        self.max_block_s = max_block_s
        # Rows take one of ``max_queue`` slots until the thread takes them; failures (a few
        # bytes each) take none, so a refusal is queued even when the queue is full, and comes
        # after the rows of its request that are already queued.
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._slots = threading.Semaphore(max_queue)
        self._health = threading.Lock()
        self._unhealthy: str | None = None
        self._thread = threading.Thread(target=self._run, name="hsfarm-dump-writer", daemon=True)
        self._open: dict[str, _Open] = {}  # the writer thread's own
        self.written = 0
        self.errors = 0
        self.blocked_s = 0.0  # time callers spent waiting on a full queue (backpressure)
        self.max_depth = 0
        dumpdir.ensure(dump_dir)  # refuses a dir another user owns or can write to
        self._thread.start()

    @property
    def unhealthy(self) -> str | None:
        """Why the writer cannot take the engine's requests now; None while it can."""
        return self._unhealthy

    def submit(self, job: Job) -> None:
        """Queue a job. Rows wait up to ``max_block_s`` while the queue is full
        (backpressure); an unhealthy writer refuses them instead (``_refuse``). Never raises."""
        if not self._thread.is_alive():
            self._refuse(job)
        elif isinstance(job, Failed):
            self._q.put(job)
        elif (self._slots.acquire(blocking=False)
              or (self._unhealthy is None and self._wait_for_room())):
            self._q.put(job)
            self.max_depth = max(self.max_depth, self._q.qsize())
        else:
            self._refuse(job)

    def _wait_for_room(self) -> bool:
        """Wait for a slot, up to ``max_block_s``; False (and unhealthy) if none came."""
        t0 = time.perf_counter()
        deadline = t0 + self.max_block_s
        try:
            while self._thread.is_alive():
                left = deadline - time.perf_counter()
                if left <= 0:
                    self._set_unhealthy(
                        f"behind: its queue of {self.max_queue} passes stayed full for "
                        f"{self.max_block_s:.0f}s (the dump dir slower than the engine, or the "
                        "writer stuck); requests are refused until it catches up")
                    return False
                if self._slots.acquire(timeout=min(left, 0.5)):
                    return True
            return False
        finally:
            self.blocked_s += time.perf_counter() - t0

    def _refuse(self, job: Job) -> None:
        """Give each request of ``job`` an ``.err`` instead of its rows. A running thread
        writes it in order, after the rows it already holds, and drops the dump it started
        (its later chunks are then ignored), so a refused chunk never leaves a dump with a
        hole; a dead one cannot, so it is written here."""
        if not self._thread.is_alive():
            self._set_unhealthy(self._not_running())
        why = f"{ERR_WRITER_UNHEALTHY}: {self._unhealthy}"
        failures = [job] if isinstance(job, Failed) else \
            [Failed(rid, why) for rid in dict.fromkeys(r.rid for r in job)]
        for failed in failures:
            if self._thread.is_alive():
                self._q.put(failed)
            elif not err_path(self.dump_dir, failed.rid).exists():  # once per request
                self._write_err(failed.rid, failed.error)

    def _not_running(self) -> str:
        return ("not running: its thread has ended (the server shut it down, or it died: "
                "see the server's log); restart the server")

    def _set_unhealthy(self, why: str) -> None:
        with self._health:  # the note's file follows the state in the order of the changes
            if self._unhealthy == why:
                return
            self._unhealthy = why
            log.error("hsfarm dump writer unhealthy: %s", why)
            try:
                markers.write_unhealthy(self.dump_dir, why)
            except (OSError, dumpdir.DumpDirUnsafe):
                log.exception("cannot write the unhealthy-writer note in %s", self.dump_dir)

    def _caught_up(self) -> None:
        """Healthy again once the thread has drained its queue."""
        with self._health:
            if self._unhealthy is None or not self._q.empty():
                return
            self._unhealthy = None
            log.warning("hsfarm dump writer caught up: it takes requests again")
            with contextlib.suppress(OSError):
                markers.clear_unhealthy(self.dump_dir)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until every submitted job is on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a fault of the loop itself: say so (submit refuses)
            log.critical("hsfarm dump writer died: %s: %s", type(e).__name__, e, exc_info=True)
            self._set_unhealthy(self._not_running())

    def _serve(self) -> None:
        while True:
            job = self._q.get()
            if isinstance(job, list):
                self._slots.release()
            try:
                if job is None:
                    for rid in list(self._open):  # requests cut off by the shutdown
                        self._drop(rid)
                    return
                self._handle(job)
            except BaseException:  # no job may end the thread: its requests lose their dumps
                log.exception("hsfarm dump writer: a job failed; the writer goes on")
                for rid in _rids(job):
                    self._drop(rid)
            finally:
                self._q.task_done()
            self._caught_up()

    def _handle(self, job: Job) -> None:
        if isinstance(job, Failed):
            self._drop(job.rid)
            self._write_err(job.rid, job.error)
            return
        for rows in job:
            try:
                self._write_rows(rows)
            except BaseException as e:  # report and go on (an engine's KeyboardInterrupt too)
                self._drop(rows.rid)
                if _no_space(e):
                    self._write_err(rows.rid, f"{ERR_DUMP_DIR_FULL}: "
                                    f"{type(e).__name__}: {e}")
                else:
                    log.exception("dump writer failed for %s", rows.rid)
                    self._write_err(rows.rid, f"writer failed: {type(e).__name__}: {e}")

    def _write_rows(self, rows: Rows) -> None:
        tensors = _named(rows.staged.wait(), rows.dtype)
        if rows.prefix == 0:
            self._drop(rows.rid)  # a retried rid starts over
            if not self._start(rows, tensors):
                return
        dump = self._open.get(rows.rid)
        if dump is None:
            return  # its start failed (its .err is written): the rest of its rows are dropped
        ext = int(tensors[T_INPUT_IDS].shape[0])
        for name, t in tensors.items():
            begin, end = dump.ranges[name]
            row = (end - begin) // dump.n
            data = t.reshape(-1).view(torch.uint8).numpy()
            if data.size != ext * row:
                raise ValueError(f"{name}: {data.size} bytes for {ext} rows of {row}")
            _pwrite_all(dump.fd, memoryview(data), begin + rows.prefix * row)
            dump.left -= data.size
        if rows.prefix + ext == dump.n:
            self._finish(rows.rid, dump)

    def _start(self, rows: Rows, tensors: dict[str, torch.Tensor]) -> bool:
        """Open the temp file of ``rows``' request; False (and its .err) if it cannot fit."""
        n = rows.token_count
        spec = {k: (_TAGS[t.dtype], (n, *t.shape[1:])) for k, t in tensors.items()}
        meta = {**self.metadata, M_RID: rows.rid, M_DUMP_DTYPE: rows.dtype}
        head, ranges = header_codec.encode(spec, meta)
        need = len(head) + max(end for _, end in ranges.values())
        promised = sum(d.left for d in self._open.values())  # other dumps' rows still to come
        free = free_bytes(self.dump_dir)
        if free - promised - need < self.min_free_bytes:
            self._write_err(rows.rid, f"{ERR_DUMP_DIR_FULL}: {free} bytes free, need {need} "
                            f"+ {promised} promised to dumps being written + reserve "
                            f"{self.min_free_bytes}")
            return False
        tmp = self.dump_dir / f".{rows.rid}{TMP_MARK}{os.getpid()}"
        fd = dumpdir.create_private(tmp)
        try:
            _pwrite_all(fd, memoryview(head), 0)
            os.ftruncate(fd, need)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        self._open[rows.rid] = _Open(fd, tmp, {k: (len(head) + a, len(head) + b)
                                               for k, (a, b) in ranges.items()},
                                     meta, n, need - len(head))
        return True

    def _finish(self, rid: str, dump: _Open) -> None:
        del self._open[rid]
        try:
            os.close(dump.fd)
            self._sealing(rid, dump.tmp, dump.meta)
            os.replace(dump.tmp, dump_path(self.dump_dir, rid))
        finally:
            dump.tmp.unlink(missing_ok=True)
        self.written += 1

    def _sealing(self, rid: str, path: Path, metadata: dict[str, str]) -> None:
        """The last step before the rename (the fault injector corrupts dumps here)."""

    def _drop(self, rid: str) -> None:
        """Forget a dump being written, its temp file removed. Never raises."""
        dump = self._open.pop(rid, None)
        if dump is not None:
            with contextlib.suppress(OSError):
                os.close(dump.fd)
            with contextlib.suppress(OSError):
                dump.tmp.unlink(missing_ok=True)

    def _write_err(self, rid: str, message: str) -> None:
        self.errors += 1
        write_err(self.dump_dir, rid, message)


@dataclass
class _Pending:
    n: int
    next_pos: int = 0
    updated_s: float = 0.0


class DumpCollector:
    """Follows each of our requests chunk by chunk and hands each pass's rows to the writer.

    A gap (a chunk whose prefix is not where the last one ended: also a radix-cache hit), more
    tokens than the rid declares, or no chunk for ``ttl_s`` is reported as ``<rid>.err``, never a
    short file. Rows past the declared prompt are generated tokens of a decoding request in a
    ``--enable-mixed-chunk`` batch, not prompt rows: skipped.
    Test: tests/unit/test_dump_writer.py::test_gap_prefix_hit_and_overrun_write_err.
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
        offset, taken = 0, []
        for i in range(n_req):
            ext, prefix = int(extend_lens[i]), int(prefix_lens[i])
            start, offset = offset, offset + ext
            rid = parse_rid(rids[i])
            if rid is None or ext == 0:
                continue
            rows_of = self._take_chunk(rids[i], rid, prefix, ext, now, input_ids, hidden, aux,
                                       start)
            if rows_of is not None:
                taken.append(rows_of)
        if taken:
            self.writer.submit(taken)
        if now - self._last_sweep_s > min(self.ttl_s, 30.0):
            self.sweep(now)

    def on_request(
        self,
        rid_s: str,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: torch.Tensor,
    ) -> bool:
        """Take one whole request's rows at once (an engine that hands over a finished
        request, as vLLM's KV connector does). A rid that is not ours is ignored; a row count
        other than the rid declares is its ``.err`` at once. True if rows went to the writer.
        Test: tests/unit/test_dump_writer.py::test_a_whole_request_at_once_equals_its_chunks.
        """
        rid = parse_rid(rid_s)
        if rid is None:
            return False
        n = int(input_ids.shape[0])
        if n != rid.token_count or hidden.shape[0] != n or aux.shape[0] != n:
            self._pending.pop(rid_s, None)
            self._fail(rid_s, f"whole request: {n} token ids, {hidden.shape[0]} hidden and "
                       f"{aux.shape[0]} aux rows; the rid declares {rid.token_count}")
            return False
        taken = self._take_chunk(rid_s, rid, 0, n, self.clock(), input_ids, hidden, aux, 0)
        if taken is None:
            return False
        self.writer.submit([taken])
        return True

    def _take_chunk(
        self,
        rid_s: str,
        rid: Rid,
        prefix: int,
        ext: int,
        now: float,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: torch.Tensor,
        start: int,
    ) -> Rows | None:
        if prefix >= rid.token_count:
            return None  # a token generated after the prompt (a decode row of a mixed batch)
        state = self._pending.get(rid_s)
        if prefix == 0:
            state = self._pending[rid_s] = _Pending(n=rid.token_count)
        elif state is None or state.next_pos != prefix:
            self._pending.pop(rid_s, None)
            have = ("no earlier chunk" if state is None
                    else f"earlier chunks end at {state.next_pos}")
            self._fail(rid_s, f"gap: chunk starts at {prefix}, {have} (prefix-cache hit?)")
            return None
        end = prefix + ext
        if end > state.n:
            self._pending.pop(rid_s, None)
            self._fail(rid_s, f"overrun: {end} tokens seen, rid declares {state.n}")
            return None
        sl = slice(start, start + ext)
        dtype = dump_dtype_for(rid, self.writer.dtype)
        encode = encode_fp8 if dtype == DTYPE_FP8 else None
        staged = self.stager.stage([ids[sl], hidden[sl], aux[sl]], encode)
        state.next_pos, state.updated_s = end, now
        if end == state.n:
            del self._pending[rid_s]
        return Rows(rid_s, prefix, state.n, staged, dtype)

    def _fail(self, rid: str, message: str) -> None:
        self.writer.submit(Failed(rid, message))

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


_TAGS = {torch.int64: "I64", torch.bfloat16: "BF16", torch.float32: "F32",
         fp8.FP8: "F8_E4M3"}


def _named(tensors: list[torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """One chunk's staged tensors, by name, in the dump's dtypes, contiguous."""
    if dtype == DTYPE_FP8:
        ids, hq, hs, aq, as_ = tensors
        return {T_INPUT_IDS: ids.to(torch.int64).contiguous(),
                T_HIDDEN: hq.contiguous().view(fp8.FP8), T_HIDDEN_SCALE: hs.contiguous(),
                T_AUX: aq.contiguous().view(fp8.FP8), T_AUX_SCALE: as_.contiguous()}
    ids, hidden, aux = tensors
    return {T_INPUT_IDS: ids.to(torch.int64).contiguous(),
            T_HIDDEN: hidden.to(torch.bfloat16).contiguous(),
            T_AUX: aux.to(torch.bfloat16).contiguous()}


def _rids(job: Job | None) -> list[str]:
    if isinstance(job, Failed):
        return [job.rid]
    return [rows.rid for rows in job or []]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (one call writes at most ~2 GB)."""
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _no_space(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return "No space left on device" in str(e) or "Disk quota exceeded" in str(e)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def write_err(dump_dir: Path, rid: str, message: str) -> bool:
    """Write ``<rid>.err`` atomically: the request of ours that cannot have a dump, and why.
    False (logged) when it cannot be written; never raises: the engine's step and the
    writer's thread call it."""
    log.warning("dump error %s: %s", rid, message)
    tmp = dump_dir / f".{rid}{TMP_MARK}{os.getpid()}.err"
    try:
        dumpdir.write_private(tmp, (message + "\n").encode())
        os.replace(tmp, err_path(dump_dir, rid))
        return True
    except dumpdir.DumpDirUnsafe as e:  # not into a dir another user can write: the writer
        log.error("no .err file for %s: %s", rid, e)  # goes on, for when the dir is fixed
        return False
    except (OSError, ValueError):
        log.exception("cannot even write the .err file for %s", rid)
        with contextlib.suppress(OSError, ValueError):
            tmp.unlink(missing_ok=True)
        return False


def remove_stale_files(dump_dir: Path) -> int:
    """Remove the temp files and ready markers of hook processes that no longer exist.

    What a server killed mid-write leaves in tmpfs (RAM): its half-written ``.<rid>.tmp.<pid>``
    files and its ``.ready.<pid>`` marker. Files of living processes are never touched, nor
    anything that is not a temp file or marker of ours, nor a marker whose writer cannot be
    judged from here (``markers``: another pid namespace or boot). Returns how many were
    removed.
    """
    removed = len(markers.remove_dead(dump_dir))
    removed += len(markers.remove_dead(dump_dir, WRITER_UNHEALTHY_PREFIX))
    for path in dump_dir.iterdir():
        pid = _writer_pid(path.name) if is_temp_name(path.name) else None
        if pid is not None and not _process_exists(pid):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _writer_pid(name: str) -> int | None:
    """The pid in a ready marker's or a hook temp file's name; None for any other file."""
    prefix = next((p for p in (READY_PREFIX, WRITER_UNHEALTHY_PREFIX)
                   if name.startswith(p)), None)
    if prefix is not None:
        field = name[len(prefix):]
    elif is_temp_name(name):
        field = name.rsplit(TMP_MARK, 1)[1]
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
