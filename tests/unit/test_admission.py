"""Host-wide admission across real processes: limits hold, a killed holder frees its place."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from producer.localfarm.farm import wait_until
from worker.core.errors import NoSpace, ServerMisconfigured, Transient
from worker.core.settings import Settings
from worker.server.admission import Admission, Holding, Limits, resolve_limits

PER_TOKEN = 100


def _limits(in_flight: int = 2, budget: int = 10_000) -> Limits:
    return Limits(in_flight, budget, PER_TOKEN, "test")


def _holder(dump_dir: Path, tokens: int, log: Path, hold_s: float,
            limits: Limits) -> subprocess.Popen[bytes]:
    """A process that takes a ticket, logs enter/leave times, holds it ``hold_s``."""
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from worker.server.admission import Admission, Limits
        a = Admission(Path({str(dump_dir)!r}), Limits{tuple(limits.__dict__.values())!r}, 60)
        with a.admit({tokens}):
            with open({str(log)!r}, "a") as f:
                f.write(f"in {{time.monotonic()}}\\n")
            time.sleep({hold_s})
            with open({str(log)!r}, "a") as f:
                f.write(f"out {{time.monotonic()}}\\n")
    """)
    return subprocess.Popen([sys.executable, "-c", code])


def _max_concurrent(log: Path) -> int:
    events = sorted((float(t), 1 if kind == "in" else -1)
                    for kind, t in (line.split() for line in log.read_text().splitlines()))
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def test_at_most_max_in_flight_processes_hold_a_place(tmp_path: Path) -> None:
    # Given six processes that each want a place, and room for two
    log = tmp_path / "log"
    procs = [_holder(tmp_path, 1, log, 0.3, _limits(in_flight=2)) for _ in range(6)]
    for p in procs:
        assert p.wait(60) == 0
    # Then all got one in turn, never more than two at once
    assert log.read_text().count("in ") == 6
    assert _max_concurrent(log) == 2


def test_the_dump_budget_limits_by_bytes_but_never_blocks_a_lone_big_request(
        tmp_path: Path) -> None:
    # Given a budget of 10,000 bytes (100 tokens) and room for four requests
    log = tmp_path / "log"
    limits = _limits(in_flight=4, budget=10_000)
    # When three processes each want 60 tokens (6,000 bytes): only one fits at a time
    procs = [_holder(tmp_path, 60, log, 0.3, limits) for _ in range(3)]
    for p in procs:
        assert p.wait(60) == 0
    assert _max_concurrent(log) == 1
    # And a request bigger than the whole budget is admitted when it is alone
    with Admission(tmp_path, limits, wait_s=1).admit(500):
        pass


def test_a_killed_holder_frees_its_place_at_once(tmp_path: Path) -> None:
    # Given a process holding the only place
    log = tmp_path / "log"
    holder = _holder(tmp_path, 1, log, 600, _limits(in_flight=1))
    wait_until(lambda: log.exists() and "in " in log.read_text(), 30, "the holder")
    admission = Admission(tmp_path, _limits(in_flight=1), wait_s=0.3)
    with pytest.raises(Transient, match="no admission"), admission.admit(1):
        pass
    # When it is SIGKILLed
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    # Then the place is free without any cleanup, at the first try (an admission that waits
    # for nothing: a place still held would refuse it)
    at_once = Admission(tmp_path, _limits(in_flight=1), wait_s=0)
    with at_once.admit(1):
        assert at_once.usage() == Holding(1, PER_TOKEN)


def test_a_dump_dir_gone_at_admission_is_the_servers_not_the_samples(tmp_path: Path) -> None:
    # Given an admission over a dump dir that was used, then deleted (someone cleaned /dev/shm
    # between a sample's tokenizing and its admission)
    dump_dir = tmp_path / "dumps"
    dump_dir.mkdir()
    admission = Admission(dump_dir, _limits(), wait_s=0)
    with admission.admit(5):
        pass
    shutil.rmtree(dump_dir)
    # When a request asks for a place, Then the worker pauses on the server's fault, saying
    # what is gone and the fix (no attempt spent), and makes no dump dir of its own
    with pytest.raises(ServerMisconfigured, match=r"is gone .*mkdir -m 0700"), \
            admission.admit(5):
        pass
    assert not dump_dir.exists()
    # And once the dir is made again, its slots come back with it
    dump_dir.mkdir()
    with admission.admit(5):
        assert admission.usage().requests == 1


def test_an_answered_request_keeps_its_dump_bytes(tmp_path: Path) -> None:
    admission = Admission(tmp_path, _limits(in_flight=1, budget=1000), wait_s=0.2)
    with admission.admit(5) as ticket:
        ticket.answered()
        # the request place is free again, the dump's bytes are still held
        assert admission.usage() == Holding(0, 500)
        with admission.admit(5):  # fits: 1 request, 1000 bytes
            assert admission.usage() == Holding(1, 1000)
        with pytest.raises(Transient), admission.admit(6):  # 1100 bytes > budget
            pass
    assert admission.usage() == Holding(0, 0)


def test_limits_come_from_settings_else_the_server_and_tmpfs() -> None:
    s = Settings(max_tokens=8192)
    # Kimi: 57,352 bytes per token; SGLang's default chunk of 8192 → 8 in flight
    lim = resolve_limits(s, 7168, {"chunked_prefill_size": 8192}, dump_fs_bytes=1 << 40)
    assert (lim.max_in_flight, lim.bytes_per_token) == (8, 57_352)
    assert lim.dump_budget_bytes == 8 * 8192 * 57_352
    assert resolve_limits(s, 7168, {"chunked_prefill_size": 16384}, None).max_in_flight == 16
    assert resolve_limits(s, 7168, {"chunked_prefill_size": 16384,
                                    "max_running_requests": 12}, None).max_in_flight == 12
    assert resolve_limits(s, 7168, None, None).max_in_flight == 8
    # a small tmpfs caps the budget at half its size
    assert resolve_limits(s, 7168, None, dump_fs_bytes=4 << 30).dump_budget_bytes == 2 << 30
    # explicit settings win
    explicit = resolve_limits(Settings(max_in_flight=3, dump_budget_bytes=123), 7168,
                              {"chunked_prefill_size": 8192}, 1 << 40)
    assert (explicit.max_in_flight, explicit.dump_budget_bytes) == (3, 123)


def test_under_dp_attention_the_in_flight_default_is_per_group_and_the_budget_per_host() -> None:
    s = Settings(max_tokens=8192)
    # Given Kimi-K2.5 at --tp 8 --dp 8 --enable-dp-attention, as SGLang 0.5.23's /server_info
    # says it: resolved to attn_dp_size 8, dp_size 1, and chunked prefill divided per group
    # (16384 / 8); each group's scheduler takes its own prefill batches
    kimi = {"attn_dp_size": 8, "dp_size": 1, "enable_dp_attention": True,
            "chunked_prefill_size": 2048, "tp_size": 8}
    lim = resolve_limits(s, 7168, kimi, dump_fs_bytes=1 << 40)
    # Then each group gets what one server gets (at least 8), and the host the sum
    assert (lim.max_in_flight, lim.dp_groups) == (64, 8)
    # And the tmpfs budget is one, for the host's one tmpfs: all of them, at most half of it
    assert lim.dump_budget_bytes == 64 * 8192 * 57_352
    assert resolve_limits(s, 7168, kimi, dump_fs_bytes=16 << 30).dump_budget_bytes == 8 << 30
    # And a larger per-group chunk scales each group, the server's request cap still caps all
    assert resolve_limits(s, 7168, {**kimi, "chunked_prefill_size": 16384},
                          None).max_in_flight == 8 * 16
    assert resolve_limits(s, 7168, {**kimi, "max_running_requests": 48},
                          None).max_in_flight == 48
    # And the deprecated spelling, unresolved, counts the same; plain --dp-size (replicas of
    # a whole server, each its own /server_info) does not
    assert resolve_limits(s, 7168, {"dp_size": 4, "enable_dp_attention": True,
                                    "chunked_prefill_size": 2048}, None).max_in_flight == 32
    assert resolve_limits(s, 7168, {"dp_size": 4, "chunked_prefill_size": 2048},
                          None).max_in_flight == 8
    # And describe() says the layout
    assert lim.describe().startswith("in-flight max 64 (8 per DP group × 8 DP groups), dump "
                                     "budget 30.1 GB for the host")
    assert resolve_limits(s, 7168, None, None).describe().startswith(
        "in-flight max 8, dump budget")


def test_status_says_the_dp_groups_beside_the_hosts_limits() -> None:
    from producer.status_text import _admission_text

    a = {"max_in_flight": 64, "dump_budget_bytes": 30_071_062_528, "in_flight": 3,
         "dump_bytes_held": 0}
    assert _admission_text({**a, "dp_groups": 8}) == (
        "in flight 3/64, dumps 0.00/30.07 GB (8 DP groups; one tmpfs budget)")
    assert _admission_text({**a, "dp_groups": 1}) == "in flight 3/64, dumps 0.00/30.07 GB"


def _stream(dump_dir: Path, tokens: int, log: Path, hold_s: float, limits: Limits,
            run_s: float) -> subprocess.Popen[bytes]:
    """A process that takes tickets back to back for ``run_s``, each held ``hold_s``."""
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from worker.server.admission import Admission, Limits
        a = Admission(Path({str(dump_dir)!r}), Limits{tuple(limits.__dict__.values())!r}, 60)
        end = time.monotonic() + {run_s}
        while time.monotonic() < end:
            with a.admit({tokens}):
                with open({str(log)!r}, "a") as f:
                    f.write(f"in {{time.monotonic()}}\\n")
                time.sleep({hold_s})
    """)
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.parametrize("big_tokens", [60, 500], ids=["over-half-the-budget", "over-all-of-it"])
def test_a_big_request_is_admitted_while_small_ones_keep_coming(tmp_path: Path,
                                                                big_tokens: int) -> None:
    # Given four processes taking 15-token tickets back to back (1,500 of 10,000 bytes each:
    # the budget is never empty, and never has 6,000 bytes free for long)
    log = tmp_path / "log"
    limits = _limits(in_flight=8, budget=10_000)
    streams = [_stream(tmp_path, 15, log, 0.1, limits, run_s=20) for _ in range(4)]
    try:
        wait_until(lambda: log.exists() and log.read_text().count("in ") >= 4, 30, "the stream")
        # When a sample bigger than half the budget (or than all of it) asks for room
        t0 = time.monotonic()
        with Admission(tmp_path, limits, wait_s=8).admit(big_tokens) as ticket:
            # Then it gets in within a few holds of the small ones, not when they stop
            waited_s = time.monotonic() - t0
            assert ticket.holding.dump_bytes == big_tokens * PER_TOKEN
        assert waited_s < 5
        # And the small ones go on after it
        count = log.read_text().count("in ")
        wait_until(lambda: log.read_text().count("in ") > count, 10, "the stream after")
    finally:
        for p in streams:
            p.kill()
            p.wait(10)


def test_a_dump_larger_than_the_dump_dirs_file_system_is_refused_with_the_fix(
        tmp_path: Path) -> None:
    # Given a dump dir whose file system holds 1 MB in all
    limits = Limits(1, 10_000, PER_TOKEN, "test", dump_fs_bytes=1_000_000)
    admission = Admission(tmp_path, limits, wait_s=1)
    # When a sample needs 2 MB of dumps
    with pytest.raises(NoSpace) as e, admission.admit(20_000):
        pass
    # Then it is refused at once, saying it never fits and what to change
    assert e.value.never_fits
    assert "FARM_MAX_TOKENS" in str(e.value) and "size=" in str(e.value)
