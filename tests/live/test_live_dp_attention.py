"""DP attention live: ``--tp 2 --dp 2 --enable-dp-attention`` (gloo, CPU) with the tiny
DeepSeek-V3, the layout Kimi-K2.5 is served with (attention-TP size 1: each rank is the
attention-TP rank 0 of its own DP group, with its own scheduler, batch and dump writer).

Requests are pinned to groups with SGLang's ``routed_dp_rank``; both schedulers are traced
(strace) to see which process wrote what, for the farm's requests and for ``verify --server``'s
probe of each group. One server for the module (its start costs minutes here). DP attention
needs a tiny model whose layers are DP-aware (DeepSeek's); the tiny Llama's are not (SGLang's
``llama.py`` all-reduces its embedding over the whole TP group with each group's own token
count: a gloo size mismatch).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine_dump.live_check import check_marker
from sglang_patch.plugin import ENV_DUMP_DIR
from sglang_patch.verify import main as verify
from tests.conftest import CACHE
from tests.live.conftest import measured, running
from tests.live.reference import check_dump
from tests.live.sglang_server import LiveServer
from tests.live.test_live_deepseek import LAYERS, SERVER_ENV, SERVER_FLAGS, clear, record
from tests.live.tiny_deepseek import ensure_tiny_deepseek
from tests.live.traffic import Req, wait_dump
from tests.support.strace import traced


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return ensure_tiny_deepseek(CACHE, tiny_model)


@pytest.fixture(scope="module")
def server(module_dir: Path, model: Path) -> Iterator[LiveServer]:
    server = LiveServer(model, module_dir, module_dir / "dumps", tp=2,
                        extra=["--dp-size", "2", "--enable-dp-attention", *SERVER_FLAGS],
                        extra_env=dict(SERVER_ENV))
    with running(server, "DeepSeek-V3 tiny, --tp 2 --dp 2 --enable-dp-attention"):
        yield server


def group_pids(server: LiveServer) -> dict[int, int]:
    """DP group → pid of its scheduler (attention-TP size 1: group g is TP rank g)."""
    return server.pids_titled({g: f"scheduler_DP{g}_TP{g}" for g in range(2)})


def send_pinned(server: LiveServer, pinned: list[tuple[Req, int]]) -> None:
    with ThreadPoolExecutor(max_workers=len(pinned)) as pool:
        answers = [pool.submit(server.generate, r.rid, r.ids, 0, 300, group)
                   for r, group in pinned]
        for answer in answers:
            answer.result()


def dump_calls(trace: Path, dumps: Path) -> list[str]:
    return [ln for ln in trace.read_text().splitlines() if str(dumps) in ln]


def test_each_group_dumps_its_own_requests_once_and_an_idle_group_nothing(
        server: LiveServer, model: Path, tmp_path: Path) -> None:
    # Given the two DP groups' schedulers, each the writer of its group: one marker each
    pids = group_pids(server)
    assert sorted(pids) == [0, 1], pids
    markers = {m.name: json.loads(m.read_text()) for m in server.markers()}
    assert sorted(markers) == sorted(f".ready.{pid}" for pid in pids.values())
    assert all(m["layers_to_capture"] == LAYERS for m in markers.values())
    assert {markers[f".ready.{pid}"]["attn_dp_rank"]: g for g, pid in pids.items()} == {0: 0,
                                                                                      1: 1}
    assert all(m["dp_groups"] == 2 and m["tp_size"] == 2 for m in markers.values())
    # And verify sees both groups' writers as one server start (they share their parent)
    assert len({m["ppid"] for m in markers.values()}) == 1
    ready = check_marker(server.dumps, max_age_s=3600, env=ENV_DUMP_DIR)
    assert ready.ok and ready.detail.startswith("2 DP groups of server process "), ready.detail
    trace = {g: tmp_path / f"dp{g}.strace" for g in pids}
    # When three requests of ours go to group 1 only (group 0 runs idle passes beside them)
    idle_phase = [(clear(model, f"dp1-only-{i}", n, 900 + 40 * i), 1)
                  for i, n in enumerate((60, 9, 33))]
    with traced(pids[0], trace[0]), traced(pids[1], trace[1]):
        send_pinned(server, idle_phase)
        dumps = {r.rid: wait_dump(server.dumps, r.rid) for r, _ in idle_phase}
    # Then group 1's writer renamed each into place, and idle group 0 touched nothing
    calls = {g: dump_calls(trace[g], server.dumps) for g in pids}
    assert calls[0] == [], calls[0][:5]
    for r, _ in idle_phase:
        assert sum("rename" in ln and f"{r.rid}.safetensors" in ln for ln in calls[1]) == 1
    # When requests go to both groups at once
    split = [(clear(model, f"dp-split-{i}", n, 1100 + 40 * i), i % 2)
             for i, n in enumerate((80, 41, 7, 120))]
    trace = {g: tmp_path / f"dp{g}-split.strace" for g in pids}
    with traced(pids[0], trace[0]), traced(pids[1], trace[1]):
        send_pinned(server, split)
        dumps.update({r.rid: wait_dump(server.dumps, r.rid) for r, _ in split})
    # Then each request was written exactly once, by its own group's writer only
    calls = {g: dump_calls(trace[g], server.dumps) for g in pids}
    for r, group in split:
        renames = {g: sum("rename" in ln and f"{r.rid}.safetensors" in ln for ln in calls[g])
                   for g in pids}
        assert renames == {group: 1, 1 - group: 0}, (r.rid, renames)
    # And every dump equals transformers' states; no .err anywhere
    errors = [check_dump(dumps[r.rid], model, r.ids, LAYERS) for r, _ in idle_phase + split]
    assert not list(server.dumps.glob("*.err"))
    measured(f"DP attention (tp 2, dp 2), 7 requests pinned to groups: worst per-token error "
             f"vs transformers {max(errors):.4f}")
    record("DP attention (tp 2, dp 2), 7 requests pinned to groups", model,
           [dumps[r.rid] for r, _ in idle_phase + split])


def test_verify_probes_each_group_with_a_request_pinned_to_it(
        server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Given the two groups' schedulers, traced
    pids = group_pids(server)
    trace = {g: tmp_path / f"verify{g}.strace" for g in pids}
    # When verify checks the running server (as ops/launch-sglang.sh polls it)
    with traced(pids[0], trace[0]), traced(pids[1], trace[1]):
        code = verify(["--live-only", "--dump-dir", str(server.dumps), "--server", server.url])
    out = capsys.readouterr().out
    # Then both groups' markers pass, and one probe per group, pinned with routed_dp_rank
    assert code == 0, out
    assert "PASS  ready marker: 2 DP groups of server process " in out, out
    assert "PASS  probe request: 2 DP groups, one request pinned to each (routed_dp_rank), " \
        "each dumped by its own group: a 16-token request of ours" in out, out
    # And each group's probe was written by that group's own writer, and removed
    for g in pids:
        probes = [ln for ln in dump_calls(trace[g], server.dumps)
                  if "rename" in ln and "_hsfarm_verify_g" in ln and ".safetensors" in ln]
        assert len(probes) == 1 and f"_hsfarm_verify_g{g}_" in probes[0], probes
    assert not list(server.dumps.glob("*_hsfarm_verify_*"))
