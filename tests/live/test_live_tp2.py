"""A live TP=2 server on CPU (gloo), unchunked: one ready marker, only the attention-TP rank 0
writes (seen with strace on both ranks), and the dumps equal transformers' states (on
``conftest.attending_model``: attention whose heads, split over the two ranks, count)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.live.conftest import measured, running
from tests.live.reference import check_dump
from tests.live.sglang_server import LiveServer
from tests.live.traffic import PREFILL_LINE, log_lines_since, ours, send, vocab_size, wait_dump
from tests.support.strace import calls_on, traced


@pytest.fixture(scope="module")
def server(module_dir: Path, attending_model: Path) -> Iterator[LiveServer]:
    server = LiveServer(attending_model, module_dir, module_dir / "dumps", tp=2,
                        extra=["--chunked-prefill-size", "8192"])
    with running(server, "TP=2, --chunked-prefill-size 8192 (unchunked here)"):
        yield server


def scheduler_pids(server: LiveServer) -> dict[int, int]:
    """TP rank → pid of the server's scheduler processes."""
    return server.pids_titled({rank: f"scheduler_TP{rank}" for rank in range(server.tp)})


def test_tp2_one_marker_only_rank0_writes_and_values_equal_transformers(
        server: LiveServer, attending_model: Path, tmp_path: Path) -> None:
    # Given the two scheduler processes of a TP=2 server
    ranks = scheduler_pids(server)
    assert sorted(ranks) == [0, 1], ranks
    # Then exactly one ready marker exists: rank 0's
    markers = server.markers()
    assert [m.name for m in markers] == [f".ready.{ranks[0]}"]
    assert json.loads(markers[0].read_text())["tp_size"] == 2
    # When three prompts of ours are prefilled while both ranks are traced
    vocab = vocab_size(attending_model)
    reqs = [ours(f"tp2-{n}", n, n, vocab) for n in (300, 700, 50)]
    offset = server.log.stat().st_size
    trace = {r: tmp_path / f"rank{r}.strace" for r in ranks}
    with traced(ranks[0], trace[0]), traced(ranks[1], trace[1]), \
            ThreadPoolExecutor(4) as pool:
        for answer in send(server, reqs, pool):
            answer.result()
        dumps = [wait_dump(server.dumps, r.rid) for r in reqs]
    # Then rank 0 wrote every dump (temp file renamed into place) and rank 1 never touched
    # the dump dir
    calls = {r: calls_on(trace[r], server.dumps) for r in ranks}
    for r in reqs:
        assert any("rename" in ln and f"{r.rid}.safetensors" in ln for ln in calls[0]), r.rid
    assert calls[1] == [], calls[1][:5]
    # And the prompts ran unchunked, and the dumps equal transformers' states
    batches = log_lines_since(server, offset, PREFILL_LINE)
    assert max(int(b["tokens"]) for b in batches) >= 700
    errors = [check_dump(d, attending_model, r.ids, [2, 4, 5]) for d, r in zip(dumps, reqs,
                                                                           strict=True)]
    measured(f"TP=2 unchunked, prompts of 300/700/50 tokens: worst error {max(errors):.4f}")
