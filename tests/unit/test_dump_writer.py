"""The dump collector and writer, driven with CPU tensors laid out like SGLang's batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine_dump import markers
from engine_dump.dump_writer import DumpCollector, DumpWriter, remove_stale_files
from engine_dump.dumpfile import (
    DTYPE_BF16,
    DTYPE_FP8,
    ERR_DUMP_DIR_FULL,
    ERR_WRITER_UNHEALTHY,
    M_DUMP_DTYPE,
    M_LAYERS,
    M_RID,
    M_WRITER,
    READY_PREFIX,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    T_INPUT_IDS,
    TMP_MARK,
    dump_path,
    err_path,
)
from engine_dump.markers import write_ready_marker
from engine_dump.rids import NO_RUN, RID_PREFIX, make_rid

H = 8


class Clock:
    """A settable clock: the collector's TTL without sleeping."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _request(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (n,), generator=g)
    return ids, torch.randn(n, H, generator=g), torch.randn(n, 3 * H, generator=g)


def _batch(parts: list[tuple[str, int, int, tuple[torch.Tensor, ...]]], pad: int = 0):
    """(rid, prefix, extend, full request tensors) → collector arguments, plus padding rows."""
    rids = [p[0] for p in parts]
    prefix = [p[1] for p in parts]
    extend = [p[2] for p in parts]
    cols = [[t[pre : pre + ext] for t in full] for _, pre, ext, full in parts]
    ids, hid, aux = (torch.cat([col[i] for col in cols] + [_pad(i, pad)]) for i in range(3))
    # padding can also lengthen the per-request lists beyond len(rids) (SGLang does this)
    return dict(rids=rids, prefix_lens=prefix + [0] * bool(pad), extend_lens=extend + [pad] *
                bool(pad), input_ids=ids, hidden=hid, aux=aux)


def _pad(i: int, n: int) -> torch.Tensor:
    return torch.zeros((n,) if i == 0 else (n, H if i == 1 else 3 * H),
                       dtype=torch.int64 if i == 0 else torch.float32)


@pytest.fixture
def rig(tmp_path: Path):
    writer = DumpWriter(tmp_path, {M_LAYERS: "[2, 4, 5]"}, max_queue=2, min_free_bytes=0)
    clock = Clock()
    yield DumpCollector(writer, ttl_s=60, clock=clock), writer, clock, tmp_path
    writer.close()


def _load(d: Path, rid: str) -> dict[str, torch.Tensor]:
    return load_file(str(dump_path(d, rid)))


def test_mixed_batches_with_chunks_spread_over_batches(rig) -> None:
    col, writer, _, d = rig
    # Given two of our requests, one split into three chunks across batches, a health check,
    # a foreign client's request and padding rows
    a, b = make_rid("a", 1, 10), make_rid("b", 1, 4)
    ra, rb, rh = _request(10, 1), _request(4, 2), _request(1, 3)
    col.on_forward(**_batch([(a, 0, 3, ra), ("HEALTH_CHECK_1", 0, 1, rh)], pad=2))
    col.on_forward(**_batch([("chat-xyz", 0, 1, rh), (a, 3, 5, ra), (b, 0, 2, rb)], pad=3))
    col.on_forward(**_batch([(b, 2, 2, rb), (a, 8, 2, ra)]))
    writer.flush()
    # Then each of ours is assembled exactly, in bf16, and nothing else is written
    for rid, (ids, hid, aux) in ((a, ra), (b, rb)):
        got = _load(d, rid)
        assert torch.equal(got[T_INPUT_IDS], ids)
        assert torch.equal(got[T_HIDDEN], hid.to(torch.bfloat16))
        assert torch.equal(got[T_AUX], aux.to(torch.bfloat16))
    names = sorted(p.name for p in d.iterdir())
    assert names == sorted([f"{a}.safetensors", f"{b}.safetensors"])
    assert all(p.stat().st_mode & 0o002 == 0 for p in d.iterdir())  # not world-writable
    assert col.pending == 0


def test_chunked_equals_one_piece(rig) -> None:
    col, writer, _, d = rig
    r = _request(9, 4)
    one, many = make_rid("one", 1, 9), make_rid("many", 1, 9)
    col.on_forward(**_batch([(one, 0, 9, r)]))
    for pre in range(0, 9, 2):
        col.on_forward(**_batch([(many, pre, min(2, 9 - pre), r)]))
    writer.flush()
    x, y = _load(d, one), _load(d, many)
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_a_retried_rid_starts_over(rig) -> None:
    col, writer, _, d = rig
    r = _request(6, 5)
    rid = make_rid("k", 2, 6)
    col.on_forward(**_batch([(rid, 0, 3, r)]))
    col.on_forward(**_batch([(rid, 0, 3, r)]))  # re-sent from the start: state resets
    col.on_forward(**_batch([(rid, 3, 3, r)]))
    writer.flush()
    assert torch.equal(_load(d, rid)[T_INPUT_IDS], r[0])


def test_gap_prefix_hit_and_overrun_write_err(rig) -> None:
    col, writer, _, d = rig
    r = _request(8, 6)
    gap, hit, over = (make_rid(k, 1, 8) for k in ("gap", "hit", "over"))
    col.on_forward(**_batch([(gap, 0, 2, r), (hit, 4, 4, r), (over, 0, 6, r)]))
    col.on_forward(**_batch([(gap, 5, 3, r), (over, 6, 2, r)]))
    col.on_forward(**_batch([(make_rid("o2", 1, 3), 0, 4, r)]))
    writer.flush()
    err = {p.name: p.read_text() for p in d.glob("*.err")}
    assert "gap: chunk starts at 5, earlier chunks end at 2" in err[f"{gap}.err"]
    assert "gap: chunk starts at 4, no earlier chunk" in err[f"{hit}.err"]
    assert "overrun: 4 tokens seen, rid declares 3" in err[f"{make_rid('o2', 1, 3)}.err"]
    assert dump_path(d, over).exists()  # 6 + 2 == 8 is exactly whole
    assert not list(d.glob(f"{RID_PREFIX}*gap*.safetensors"))


def test_decode_rows_of_mixed_batches_are_not_prompt_rows(rig) -> None:
    col, writer, _, d = rig
    # Given a request of ours that decodes after its prompt, under --enable-mixed-chunk: its
    # decode rows ride in the prefill batches of another request of ours (prefix = prompt
    # length + tokens generated so far, one row each)
    r, other = _request(5, 8), _request(6, 9)
    dec, chunked = make_rid("dec", 1, 5), make_rid("chunked", 1, 6)
    col.on_forward(**_batch([(dec, 0, 5, r)]))
    gen = tuple(torch.cat([t, t[:2]]) for t in r)  # rows past the prompt
    col.on_forward(**_batch([(chunked, 0, 3, other), (dec, 5, 1, gen)]))
    col.on_forward(**_batch([(chunked, 3, 3, other), (dec, 6, 1, gen)]))
    writer.flush()
    # Then both dumps are exactly their prompts, and nothing is reported as a gap
    assert not list(d.glob("*.err"))
    assert torch.equal(_load(d, dec)[T_HIDDEN], r[1].to(torch.bfloat16))
    assert torch.equal(_load(d, chunked)[T_AUX], other[2].to(torch.bfloat16))


def test_a_whole_request_at_once_equals_its_chunks(rig) -> None:
    col, writer, _, d = rig
    # Given one request handed over whole (as vLLM's connector does) and the same rows in
    # chunks, a rid that is not ours and a request whose row count is not its rid's
    r = _request(7, 10)
    whole, chunks, short = (make_rid(k, 1, 7) for k in ("whole", "chunks", "short"))
    assert col.on_request(whole, *r)
    for pre in range(0, 7, 3):
        col.on_forward(**_batch([(chunks, pre, min(3, 7 - pre), r)]))
    assert not col.on_request("cmpl-foreign-0", *r)
    assert not col.on_request(short, *(t[:6] for t in r))
    writer.flush()
    # Then the two dumps hold the same bytes, the short one is an .err, and nothing waits
    x, y = _load(d, whole), _load(d, chunks)
    assert all(torch.equal(x[k], y[k]) for k in x)
    assert "6 token ids, 6 hidden and 6 aux rows; the rid declares 7" in \
        err_path(d, short).read_text()
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [f"{whole}.safetensors", f"{chunks}.safetensors", f"{short}.err"])
    assert col.pending == 0


def test_stale_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    # Given what a killed hook process left (a half-written dump, an .err temp, its marker
    # written by that process itself), the same from this living process, and files that
    # are not the hook's temp files
    rid = make_rid("k", 1, 4)
    gone = subprocess.run(
        [sys.executable, "-c", "import os, sys; from pathlib import Path; "
         "from engine_dump.markers import write_ready_marker; "
         "write_ready_marker(Path(sys.argv[1]), {}); print(os.getpid())", str(tmp_path)],
        capture_output=True, text=True, check=True)
    pid = int(gone.stdout)
    stale = [f".{rid}{TMP_MARK}{pid}", f".{rid}{TMP_MARK}{pid}.err",
             f"{READY_PREFIX}{pid}{TMP_MARK}"]
    alive = [f".{rid}{TMP_MARK}{os.getpid()}"]
    others = [f"{rid}.safetensors", f"{rid}.err", "notes.txt", f".x{TMP_MARK}not-a-pid"]
    for name in stale + alive + others:
        (tmp_path / name).write_text("x")
    write_ready_marker(tmp_path, {})
    alive.append(f"{READY_PREFIX}{os.getpid()}")
    stale.append(f"{READY_PREFIX}{pid}")
    # When a new hook starts in that dump dir
    removed = remove_stale_files(tmp_path)
    # Then exactly the dead process's files are gone
    assert removed == len(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(alive + others)


def test_abandoned_requests_are_dropped_after_ttl(rig) -> None:
    col, writer, clock, d = rig
    r = _request(8, 7)
    rid = make_rid("slow", 1, 8)
    col.on_forward(**_batch([(rid, 0, 3, r)]))
    clock.now = 59
    assert col.sweep() == 0
    clock.now = 61
    assert col.sweep() == 1
    writer.flush()
    assert "incomplete: 3 of 8 tokens" in err_path(d, rid).read_text()
    assert col.pending == 0
    assert [p.name for p in d.iterdir()] == [f"{rid}.err"]  # its temp file is gone too


def test_too_few_rows_is_a_layout_error(rig) -> None:
    col, _, _, _ = rig
    r = _request(4, 8)
    args = _batch([(make_rid("x", 1, 4), 0, 4, r)])
    args["hidden"] = args["hidden"][:2]
    with pytest.raises(ValueError, match="batch layout"):
        col.on_forward(**args)


def test_full_dump_dir_writes_err_not_a_file(tmp_path: Path) -> None:
    # Given a writer that must keep more free space than any disk has
    writer = DumpWriter(tmp_path, {}, min_free_bytes=1 << 62)
    col = DumpCollector(writer)
    rid = make_rid("big", 1, 4)
    col.on_forward(**_batch([(rid, 0, 4, _request(4, 9))]))
    writer.flush()
    writer.close()
    assert err_path(tmp_path, rid).read_text().startswith("dump dir full")
    assert not dump_path(tmp_path, rid).exists()
    assert [p.name for p in tmp_path.iterdir()] == [f"{rid}.err"]


def test_enospc_past_the_free_space_check_is_a_full_dump_dir(tmp_path: Path) -> None:
    # Given a real 1 MB tmpfs and no reserve: a dump of 64 tokens (0.5 MB) passes the free
    # space check at its first chunk, then something else fills the tmpfs
    from tests.support.faults import can_mount_tmpfs, small_tmpfs

    if not can_mount_tmpfs(tmp_path):
        pytest.skip("this machine does not let the test mount a small tmpfs (needs root)")
    with small_tmpfs(tmp_path / "dumps", "1M") as dumps:
        writer = DumpWriter(dumps, {}, min_free_bytes=0)
        col = DumpCollector(writer)
        rid = make_rid("big", 1, 64)
        r = (torch.arange(64), torch.randn(64, 1024), torch.randn(64, 3072))
        col.on_forward(**_wide_batch(rid, 0, 8, r))
        writer.flush()
        with open(dumps / "filler", "wb") as f, pytest.raises(OSError):
            f.write(b"\0" * (1 << 20))
        # When its next chunk's write fails with ENOSPC
        col.on_forward(**_wide_batch(rid, 8, 56, r))
        writer.flush()
        writer.close()
        # Then the worker is told the dump dir is full (it waits), not that the dump failed,
        # and the half-written temp file is gone
        assert err_path(dumps, rid).read_text().startswith(ERR_DUMP_DIR_FULL)
        assert sorted(p.name for p in dumps.iterdir()) == sorted(["filler", f"{rid}.err"])


def _wide_batch(rid: str, prefix: int, ext: int, full: tuple[torch.Tensor, ...]):
    """One request's chunk as collector arguments, for any hidden size."""
    sl = slice(prefix, prefix + ext)
    return dict(rids=[rid], prefix_lens=[prefix], extend_lens=[ext], input_ids=full[0][sl],
                hidden=full[1][sl], aux=full[2][sl])


@pytest.mark.parametrize("dtype", [DTYPE_BF16, DTYPE_FP8])
def test_a_dump_is_written_as_its_chunks_arrive_with_the_librarys_bytes(
        tmp_path: Path, dtype: str) -> None:
    from safetensors.torch import save_file

    from engine_dump.dump_writer import encode_fp8

    # Given two requests of ours whose chunks share passes
    writer = DumpWriter(tmp_path, {M_LAYERS: "[2, 4, 5]"}, min_free_bytes=0, dtype=dtype)
    col = DumpCollector(writer)
    a, b = make_rid("a", 1, 10), make_rid("b", 1, 7)
    ra, rb = _request(10, 11), _request(7, 12)
    col.on_forward(**_batch([(a, 0, 4, ra), (b, 0, 3, rb)]))
    writer.flush()
    # Then after the first pass each request's rows are already in its temp file, at their
    # place in a file of the whole dump's size (the server holds no earlier chunk)
    tmp = {p.name.split(TMP_MARK)[0][1:]: p for p in tmp_path.iterdir()}
    assert set(tmp) == {a, b}
    whole = {}
    for rid, (ids, hid, aux) in ((a, ra), (b, rb)):
        named = {T_INPUT_IDS: ids, T_HIDDEN: hid.to(torch.bfloat16),
                 T_AUX: aux.to(torch.bfloat16)}
        if dtype == DTYPE_FP8:
            q = encode_fp8([ids, hid, aux])
            named = {T_INPUT_IDS: ids, T_HIDDEN: q[1].view(torch.float8_e4m3fn),
                     T_HIDDEN_SCALE: q[2], T_AUX: q[3].view(torch.float8_e4m3fn),
                     T_AUX_SCALE: q[4]}
        ref = tmp_path.parent / f"{rid}.ref"
        save_file(named, str(ref), metadata={M_LAYERS: "[2, 4, 5]", M_RID: rid,
                                             M_DUMP_DTYPE: dtype,
                                             M_WRITER: markers.writer_id()})
        whole[rid] = ref.read_bytes()
    assert tmp[a].stat().st_size == len(whole[a])
    head, data = _split(tmp[a].read_bytes())
    assert head == _split(whole[a])[0]
    assert data[:32] == _split(whole[a])[1][:32]  # ids 0-3 (ids lead the data)
    # When the rest arrives in later passes
    col.on_forward(**_batch([(b, 3, 4, rb), (a, 4, 3, ra)]))
    col.on_forward(**_batch([(a, 7, 3, ra)]))
    writer.flush()
    writer.close()
    # Then each dump has what the safetensors library writes for the whole request: the same
    # header (the library orders metadata at random, so compared parsed) and data bytes; and
    # no temp file is left
    for rid in (a, b):
        got = dump_path(tmp_path, rid).read_bytes()
        assert _split(got)[0] == _split(whole[rid])[0]
        assert _split(got)[1] == _split(whole[rid])[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{r}.safetensors" for r in (a, b))


def _split(raw: bytes) -> tuple[dict, bytes]:
    """A safetensors file's parsed header and its data bytes."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def test_the_free_space_check_counts_the_dumps_being_written(tmp_path: Path) -> None:
    # Given a real 2.5 MB tmpfs with room for one dump of 64 tokens (1.6 MB) but not two
    from tests.support.faults import can_mount_tmpfs, small_tmpfs

    if not can_mount_tmpfs(tmp_path):
        pytest.skip("this machine does not let the test mount a small tmpfs (needs root)")
    r = (torch.arange(64), torch.randn(64, 3072), torch.randn(64, 3 * 3072))
    with small_tmpfs(tmp_path / "dumps", "2560K") as dumps:
        writer = DumpWriter(dumps, {}, min_free_bytes=0)
        col = DumpCollector(writer)
        a, b = make_rid("a", 1, 64), make_rid("b", 1, 64)
        # When both start in one pass, each with 8 of its rows written so far
        col.on_forward(**_two(a, b, 0, 8, r))
        col.on_forward(**_two(a, b, 8, 56, r))
        writer.flush()
        writer.close()
        # Then the second is refused at its start for the bytes promised to the first, not
        # only those on the tmpfs, and the first is whole
        assert "promised to dumps being written" in err_path(dumps, b).read_text()
        assert torch.equal(_load(dumps, a)[T_AUX], r[2].to(torch.bfloat16))
        assert sorted(p.name for p in dumps.iterdir()) == [f"{a}.safetensors", f"{b}.err"]


def _two(a: str, b: str, prefix: int, ext: int, r: tuple[torch.Tensor, ...]):
    one = _wide_batch(a, prefix, ext, r)
    return dict(rids=[a, b], prefix_lens=[prefix] * 2, extend_lens=[ext] * 2,
                **{k: torch.cat([one[k], one[k]]) for k in ("input_ids", "hidden", "aux")})


def test_bounded_queue_applies_backpressure(tmp_path: Path) -> None:
    # Given a writer whose thread is stuck (the staged copy never completes)
    import threading

    gate = threading.Event()

    class Slow:
        def stage(self, tensors, encode=None):
            class S:
                def wait(self):
                    gate.wait()
                    return [t.clone() for t in tensors]
            return S()

    writer = DumpWriter(tmp_path, {}, max_queue=1, min_free_bytes=0)
    col = DumpCollector(writer, stager=Slow())
    r = _request(2, 10)
    done = threading.Event()

    def produce() -> None:
        for i in range(4):
            col.on_forward(**_batch([(make_rid(f"q{i}", 1, 2), 0, 2, r)]))
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    # Then the producer blocks (1 in the writer + 1 queued) instead of piling up memory
    assert not done.wait(0.5)
    gate.set()
    assert done.wait(10)
    t.join()
    writer.flush()
    writer.close()
    assert len(list(tmp_path.glob("*.safetensors"))) == 4


# --- the writer's health: no job kills it, and a dead or stuck one never blocks the caller ---

class _Boom(BaseException):
    """Not an Exception: what a job might raise that a plain ``except Exception`` lets by."""


class _Raising:
    """A stager whose staged copy raises ``_Boom`` when the writer waits on it."""

    def stage(self, tensors, encode=None):
        class S:
            def wait(self):
                raise _Boom("the copy failed")
        return S()


class _Gated:
    """A stager whose staged copies complete only once ``gate`` is set: a stuck writer."""

    def __init__(self) -> None:
        import threading

        self.gate = threading.Event()

    def stage(self, tensors, encode=None):
        gate = self.gate

        class S:
            def wait(self):
                gate.wait()
                return [t.clone() for t in tensors]
        return S()


def _in_thread(fn, timeout_s: float) -> float | None:
    """Run ``fn`` in a daemon thread; the seconds it took, or None if it still runs after
    ``timeout_s`` (a blocked caller: the test goes on, the thread is left behind)."""
    import threading
    import time

    took: list[float] = []

    def run() -> None:
        t0 = time.monotonic()
        fn()
        took.append(time.monotonic() - t0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    return took[0] if took else None


def test_a_job_that_raises_anything_does_not_kill_the_writer(tmp_path: Path) -> None:
    from engine_dump.dump_writer import Failed

    # Given a writer handed a failure whose .err cannot even be named (a rid too long for a
    # file name), then rows whose staged copy raises a BaseException
    writer = DumpWriter(tmp_path, {}, min_free_bytes=0, max_block_s=2)
    too_long = f"hsd-{NO_RUN}-{'k' * 300}-a1-n2"
    writer.submit(Failed(too_long, "its name is over NAME_MAX"))
    boom = make_rid("boom", 1, 2)
    DumpCollector(writer, stager=_Raising()).on_forward(**_batch([(boom, 0, 2, _request(2, 1))]))
    # When a request after them is dumped
    ok = make_rid("after", 1, 3)
    r = _request(3, 2)
    DumpCollector(writer).on_forward(**_batch([(ok, 0, 3, r)]))
    writer.flush(timeout_s=10)
    # Then the writer lives on and wrote it; the raising job got its .err; it says healthy
    try:
        assert torch.equal(_load(tmp_path, ok)[T_INPUT_IDS], r[0])
        assert "writer failed: _Boom: the copy failed" in err_path(tmp_path, boom).read_text()
        assert writer.unhealthy is None
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f"{ok}.safetensors", f"{boom}.err"])
    finally:
        writer.close()


def test_submit_to_a_dead_writer_refuses_at_once_with_an_err(tmp_path: Path) -> None:
    from engine_dump import markers as mk

    # Given a writer whose thread no longer runs (here: closed; a thread that died alike)
    writer = DumpWriter(tmp_path, {}, max_queue=1, min_free_bytes=0)
    writer.close()
    col = DumpCollector(writer)
    rids = [make_rid(f"d{i}", 1, 2) for i in range(3)]
    r = _request(2, 3)

    def send() -> None:
        for rid in rids:
            col.on_forward(**_batch([(rid, 0, 2, r)]))

    # When the engine hands it more requests than its queue holds
    took = _in_thread(send, timeout_s=10)
    # Then no call blocks: each request is refused with an .err the worker waits on (the
    # server's fault), and the writer says it is unhealthy, in a note verify and workers read
    assert took is not None and took < 5, "submit blocked on a dead writer"
    for rid in rids:
        assert err_path(tmp_path, rid).read_text().startswith(ERR_WRITER_UNHEALTHY)
    assert writer.unhealthy is not None and "not running" in writer.unhealthy
    notes = mk.unhealthy_writers(tmp_path)
    assert [n.info["pid"] for n in notes] == [os.getpid()]
    assert "not running" in str(notes[0].info["why"])


def test_a_stuck_writer_refuses_after_a_bounded_wait_and_recovers(tmp_path: Path) -> None:
    from engine_dump import markers as mk

    # Given a writer stuck on its first job (its copy never completes) with one job queued
    stager = _Gated()
    writer = DumpWriter(tmp_path, {}, max_queue=1, min_free_bytes=0, max_block_s=1.0)
    col = DumpCollector(writer, stager=stager)
    r = _request(2, 4)
    first, queued, late, later = (make_rid(k, 1, 2) for k in ("s0", "s1", "s2", "s3"))
    try:
        col.on_forward(**_batch([(first, 0, 2, r)]))
        col.on_forward(**_batch([(queued, 0, 2, r)]))
        # When the engine hands it one more, then another
        took_late = _in_thread(lambda: col.on_forward(**_batch([(late, 0, 2, r)])), 10)
        took_later = _in_thread(lambda: col.on_forward(**_batch([(later, 0, 2, r)])), 10)
        # Then the first waits the bound (backpressure) and is refused, the next is refused at
        # once, and the writer is unhealthy (behind) in its note
        assert took_late is not None and 0.9 < took_late < 5, took_late
        assert took_later is not None and took_later < 0.5, took_later
        assert writer.unhealthy is not None and "behind" in writer.unhealthy
        assert [n.info["pid"] for n in mk.unhealthy_writers(tmp_path)] == [os.getpid()]
        # And once it moves again, the jobs it had are written, the refused ones get their
        # .err (after them, in order), and it is healthy again, its note gone
        stager.gate.set()
        writer.flush(timeout_s=10)
        assert {p.name for p in tmp_path.iterdir()} == {
            f"{first}.safetensors", f"{queued}.safetensors", f"{late}.err", f"{later}.err"}
        for rid in (late, later):
            assert err_path(tmp_path, rid).read_text().startswith(ERR_WRITER_UNHEALTHY)
        assert writer.unhealthy is None and mk.unhealthy_writers(tmp_path) == []
    finally:
        stager.gate.set()
        writer.close()


def test_a_refused_chunk_never_leaves_a_dump_with_a_hole(tmp_path: Path) -> None:
    # Given a stuck writer holding a request's first chunk, its second chunk refused
    stager = _Gated()
    writer = DumpWriter(tmp_path, {}, max_queue=1, min_free_bytes=0, max_block_s=0.3)
    col = DumpCollector(writer, stager=stager)
    r = _request(6, 5)
    rid, other = make_rid("holed", 1, 6), make_rid("other", 1, 2)
    try:
        col.on_forward(**_batch([(rid, 0, 2, r)]))
        col.on_forward(**_batch([(other, 0, 2, _request(2, 6))]))  # fills the queue
        col.on_forward(**_batch([(rid, 2, 2, r)]))  # refused after 0.3 s
        # When the writer moves again and the request's last chunk arrives
        stager.gate.set()
        writer.flush(timeout_s=10)
        col.on_forward(**_batch([(rid, 4, 2, r)]))
        writer.flush(timeout_s=10)
        # Then the request has its .err and no dump (its middle rows were never written)
        assert err_path(tmp_path, rid).read_text().startswith(ERR_WRITER_UNHEALTHY)
        assert {p.name for p in tmp_path.iterdir()} == {f"{rid}.err", f"{other}.safetensors"}
    finally:
        stager.gate.set()
        writer.close()
