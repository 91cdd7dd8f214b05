"""The reference server's attention-DP groups over real HTTP (SGLang 0.5.23's dispatch and
lockstep), ``verify --server`` probing each group, and workers pinning their requests."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engine_dump.dumpfile import dump_path
from engine_dump.engines import dp_groups
from engine_dump.rids import make_rid
from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import CACHE, FarmFactory, wait_finished, write_samples

H = 256
SERVER = ["--model", "synthetic", "--hidden-size", str(H), "--attn-dp-size", "2",
          "--tokens-per-s", "20000"]


@pytest.fixture(scope="module")
def farm(module_farm_factory: FarmFactory) -> LocalFarm:
    """Redis and a synthetic server with 2 DP groups (chunk 64 per group); workers that pin
    their requests (least-tokens)."""
    return module_farm_factory("dp", model="synthetic", chunked_prefill_size=64,
                               env={"FARM_DP_ROUTING": "least-tokens"}, server_args=SERVER[2:])


def post(farm: LocalFarm, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{farm.server_port}/generate",
                                 data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def group_of(farm: LocalFarm, rid: str, n: int = 3, **extra: Any) -> int:
    """The group that served a request of ``n`` tokens (SGLang's ``meta_info.dp_rank``)."""
    status, answer = post(farm, {"rid": rid, "input_ids": list(range(10, 10 + n)), **extra})
    assert status == 200, answer
    return int(answer["meta_info"]["dp_rank"])


def info(farm: LocalFarm) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{farm.server_port}/server_info") as r:
        return dict(json.loads(r.read()))


def test_requests_go_round_robin_unless_pinned_as_in_sglang(farm: LocalFarm) -> None:
    # Given the server, which says its groups as SGLang 0.5.23's /server_info does
    assert dp_groups(info(farm)) == 2 and info(farm)["load_balance_method"] == "round_robin"
    # When unpinned requests alternate with pinned ones and a health check
    first = group_of(farm, "a")
    assert group_of(farm, "p1", routed_dp_rank=first) == first
    assert group_of(farm, "p2", data_parallel_rank=first) == first  # the deprecated alias
    with urllib.request.urlopen(f"http://127.0.0.1:{farm.server_port}/health_generate") as r:
        assert r.status == 200
    # Then the unpinned ones went round robin, the others never moving its counter
    assert [group_of(farm, f"b{i}") for i in range(3)] == [1 - first, first, 1 - first]
    # And a group the server does not have is refused with SGLang's message
    assert post(farm, {"rid": "x", "input_ids": [10], "routed_dp_rank": 2}) == (
        400, {"error": {"message": "routed_dp_rank=2 out of range [0, 2)"}, "object": "error"})
    routed = [g["requests_routed"] for g in info(farm)["dp_groups"]]
    assert routed[first] >= 2


def test_groups_step_together_and_an_idle_group_runs_idle_passes(farm: LocalFarm) -> None:
    # Given the per-group load so far
    before = info(farm)
    idle = before["dp_groups"][1]["idle_passes"]
    # When a 200-token request of ours runs pinned to group 0 alone (4 chunks of 64)
    rid = make_rid("dp-lockstep", 1, 200)
    assert group_of(farm, rid, 200, routed_dp_rank=0) == 0
    wait_until(lambda: dump_path(farm.dump_dir, rid).exists(), 30, "the dump")
    after = info(farm)
    # Then group 1 ran an idle pass beside each of group 0's, and the steps were half used
    assert after["dp_groups"][1]["idle_passes"] - idle == 4
    assert after["dp_step_tokens"] - before["dp_step_tokens"] == 200
    assert after["dp_step_capacity"] - before["dp_step_capacity"] == 400
    # And group 0's dump is counted in the dump dir until it is collected
    size = dump_path(farm.dump_dir, rid).stat().st_size
    assert after["dp_groups"][0]["dump_bytes_in_dir"] == size
    assert after["dp_groups"][1]["dump_bytes_in_dir"] == 0
    dump_path(farm.dump_dir, rid).unlink()
    assert info(farm)["dp_groups"][0]["dump_bytes_in_dir"] == 0


def verify(farm: LocalFarm, port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sglang_patch", "verify", "--live-only",
                           "--dump-dir", str(farm.dump_dir), "--server",
                           f"http://127.0.0.1:{port}", "--timeout-s", "20"],
                          capture_output=True, text=True, timeout=120)


def test_verify_probes_every_group_and_names_the_one_that_fails(
        farm: LocalFarm, tmp_path: Path) -> None:
    # When verify probes the server with 2 DP groups
    res = verify(farm, farm.server_port)
    # Then it sent one request pinned to each group and checked each dump
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASS  probe request: 2 DP groups, one request pinned to each (routed_dp_rank), " \
        "each dumped by its own group: a 16-token request of ours" in res.stdout, res.stdout
    routed = info(farm)["dp_groups"]
    assert all(g["requests_routed"] >= 1 for g in routed)
    # Given a server whose group 1 writes a broken dump of the probe
    bad = LocalFarm(tmp_path / "bad", model="synthetic", cache_dir=CACHE,
                    chunked_prefill_size=64, dumps=farm.dump_dir)
    try:
        bad.start_server([*SERVER[2:], "--inject-fault", "nan:_hsfarm_verify_g1"])
        res = verify(farm, bad.server_port)
    finally:
        bad.close(kill=True)
    # Then verify fails and names that group, and the other as passed
    assert res.returncode == 1
    assert "FAIL  probe request: DP group 1 of 2: the probe's dump is wrong: hidden_state " \
        "has NaN/Inf values" in res.stdout, res.stdout
    assert res.stdout.rstrip().endswith("(groups 0 passed)"), res.stdout


def test_workers_pin_each_request_to_the_group_with_the_fewest_tokens_waiting(
        farm: LocalFarm, tmp_path: Path) -> None:
    # Given workers with FARM_DP_ROUTING=least-tokens
    before = [g["requests_routed"] for g in info(farm)["dp_groups"]]
    farm.start_worker("w1", concurrency=3)
    # When 8 samples run
    data = tmp_path / "data.json"
    write_samples(data, 8)
    assert farm.cli("enqueue", str(data), "--no-progress").returncode == 0
    wait_finished(farm, 8)
    # Then every sample's request was pinned (routed_dp_rank), and both groups served some
    routed = [g["requests_routed"] - b for g, b in zip(info(farm)["dp_groups"], before,
                                                       strict=True)]
    assert sum(routed) >= 8 and min(routed) >= 1, routed
    status = json.loads(farm.cli("status", "--json").stdout)
    assert status["admission"]["dp_groups"] == 2 and status["done"] == 8
