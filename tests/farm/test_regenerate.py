"""A regenerating run on the reference server: each sample's assistant turns are the served model's
own, generated once each across a SIGKILL of the worker, and the states extracted are those of
the regenerated conversation."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import EXAMPLES, FarmFactory, assert_farm_invariants, wait_finished
from tests.support.faults import dashboard_metrics, enqueue, run_hash, write_jsonl
from training.loader import HiddenStates
from training.sample_file import SampleFile
from worker.core.finalfile import M_GENERATION, M_MESSAGES
from worker.core.settings import generation_identity
from worker.regen import record as gen
from worker.state import keys as state_keys
from worker.state.index import RunIndex

GEN_ENV = {"FARM_REGENERATE": "1", "FARM_GEN_MAX_NEW_TOKENS": "16", "FARM_GEN_TEMPERATURE": "0.8",
           "FARM_GEN_ON_LENGTH": "keep", "FARM_VISIBILITY_TIMEOUT_S": "120"}
GENERATED = re.compile(r"generated rid=hsgen-[0-9a-f]{16}-(?P<key>.+)-t(?P<turn>\d+)-r\d+ ")


def _generated(index: RunIndex) -> int:
    return int(index.generated().get("turns", 0))


def _requests(log: Path, start: int = 0) -> list[tuple[str, int]]:
    """(sample key, turn) of every generation the server answered, from byte ``start`` of its
    log on."""
    text = log.read_bytes()[start:].decode(errors="replace")
    return [(m["key"], int(m["turn"])) for m in GENERATED.finditer(text)]


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate",
                                 data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def test_a_regenerating_run_generates_each_turn_once_across_a_worker_sigkill(
        farm_factory: FarmFactory, tmp_path: Path, tokenizer: Any) -> None:
    # Given a farm that regenerates (16 new tokens a turn, sampled), its server slowed so a
    # turn takes a while, and 10 samples of 1 to 4 user turns, a prompt without a reply (the
    # run answers it) and a pre-tokenized record (it has no turns to answer)
    farm: LocalFarm = farm_factory("farm", env=GEN_ENV,
                                   server_args=["--forward-delay-s", "0.03"])
    keys = enqueue(farm, tmp_path, 10)
    prompt_only: dict[str, object] = {"id": "prompt-only", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]}
    others = write_jsonl(tmp_path / "more.jsonl", [
        prompt_only, {"id": "ids-only", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    res = farm.cli("enqueue", str(others), "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    keys.append("prompt-only")
    originals = {s["id"]: s for s in json.loads((tmp_path / "data.json").read_text())}
    originals["prompt-only"] = prompt_only
    turns_in_all = sum(len(gen.reply_positions(_messages(s))) for s in originals.values())
    index = RunIndex(farm.redis(), farm.run_id())
    server_log = farm.procs["server"].log

    # When a worker has generated a few turns and is SIGKILLed, with its process group
    farm.start_worker("w1", concurrency=2)
    wait_until(lambda: _generated(index) >= 4, 120, "four regenerated turns", poll_s=0.1)
    farm.procs["w1"].kill_group()
    killed_at = server_log.stat().st_size
    kept = {k: len(gen.load(farm.output_dir, farm.run_id(), k, _sha(farm, k), _identity(farm)
                            ).turns) for k in keys}
    assert sum(kept.values()) >= 4
    # and another worker takes the run over
    farm.start_worker("w2", concurrency=2)
    wait_finished(farm, total=12, timeout_s=300)

    # Then every sample is done but the pre-tokenized one, rejected with the reason
    assert_farm_invariants(farm, keys)
    rejected = json.loads(run_hash(farm, state_keys.REJECTED)["ids-only"])
    assert "cannot be regenerated" in rejected["reason"]
    # And no turn that was kept when the worker died was asked of the server again
    again = [(k, t) for k, t in _requests(server_log, killed_at) if t < kept[k]]
    assert not again, f"finished turns decoded again: {again}"
    # And every turn of every sample was generated, at least once and in all at most once
    # more than it was kept (the turns in flight at the kill)
    asked = _requests(server_log)
    assert {(k, t) for k, t in asked} == {
        (str(k), t) for k, s in originals.items()
        for t in range(len(gen.reply_positions(_messages(s))))}
    assert len(asked) <= turns_in_all + 2

    # And each final file holds the regenerated conversation: its ids are that conversation's
    # chat template, each assistant turn is the model's decoded reply, the rest as given
    for key in keys:
        f = SampleFile.open(farm.output_dir / "samples" / _shard(key) / f"{key}.safetensors")
        messages = json.loads(f.metadata[M_MESSAGES])
        said = json.loads(f.metadata[M_GENERATION])
        original = _messages(originals[key])
        positions = gen.reply_positions(original)
        assert [t["position"] for t in said["turns"]] == positions
        assert said["generation"]["max_new_tokens"] == 16
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert f.read("input_ids").tolist() == ids
        for i, m in enumerate(messages):
            if i not in positions:
                assert m == original[i]
        for t in said["turns"]:
            body = t["output_ids"][:-1] if t["finish"] == "stop" else t["output_ids"]
            assert messages[t["position"]]["content"] == tokenizer.decode(
                body, skip_special_tokens=False)
            assert messages[t["position"]] != [*original, None][t["position"]]

    # And a turn asked again with its seed is the same reply (the reference server honours
    # seeds, as vLLM does): a lost record regenerates what it held
    key = next(k for k in keys if len(gen.reply_positions(_messages(originals[k]))) > 1)
    f = SampleFile.open(farm.output_dir / "samples" / _shard(key) / f"{key}.safetensors")
    messages = json.loads(f.metadata[M_MESSAGES])
    turn = json.loads(f.metadata[M_GENERATION])["turns"][1]
    prompt = tokenizer(tokenizer.apply_chat_template(messages[: turn["position"]], tokenize=False,
                                                     add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    answer = _post(farm.server_port, {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0.8, "sampling_seed": turn["seed"]}})
    assert answer["output_ids"] == turn["output_ids"]

    # And the loader and every trainer's container say which conversation each sample's
    # states are of: the loader from the file, the export's ledger line beside each file
    ds = HiddenStates(farm.output_dir)
    by_key = {k: ds.conversation(i) for i, k in enumerate(ds.keys)}
    assert set(by_key) == set(keys)
    for key, conv in by_key.items():
        assert conv is not None and conv["generation"]["turns"]
        f = SampleFile.open(farm.output_dir / "samples" / _shard(key) / f"{key}.safetensors")
        assert conv["messages"] == json.loads(f.metadata[M_MESSAGES])
    for fmt in ("specforge", "modelopt", "speculators"):
        dest = tmp_path / fmt
        res = subprocess.run([sys.executable, "-m", "producer", "export", "--to", fmt,
                              str(dest), "--from", str(farm.output_dir)],  # with torch
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        lines = [json.loads(x) for x in (dest / "hsfarm-export.jsonl").read_text().splitlines()]
        assert {x["key"]: x["messages"] for x in lines} == {
            k: c["messages"] for k, c in by_key.items() if c is not None}
        assert all(x["generation"]["turns"] for x in lines)

    # And status and the dashboard's metrics show the run's generation beside its extraction
    res = farm.cli("status")
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"^generate  \d+ turns regenerated, \d+ tokens", res.stdout, re.M), res.stdout
    snapshot, metrics = dashboard_metrics(farm.settings())
    assert snapshot["status"]["generation"]["turns"] == _generated(index) > 0
    ended = index.generated()  # samples whose last turn was generated, and their turns
    assert 0 < ended["samples"] <= len(keys)
    assert ended["samples"] <= ended["sample_turns"] <= 4 * ended["samples"]
    assert re.search(rf"^hsfarm_generated_turns_total{{run=\"{farm.run_id()}\"}} "
                     rf"{_generated(index)}$", metrics, re.M), metrics


def _messages(sample: dict[str, Any]) -> list[dict[str, str]]:
    roles = {"human": "user", "gpt": "assistant"}
    if "messages" in sample:
        return [{"role": m["role"], "content": m["content"]} for m in sample["messages"]]
    return [{"role": roles.get(m["from"], m["from"]), "content": m["value"]}
            for m in sample["conversations"]]


def _shard(key: str) -> str:
    from worker.core.outdir import shard_of

    return shard_of(key)


def _sha(farm: LocalFarm, key: str) -> str:
    """The record's content hash, as the run holds it ("fid|offset|length|sha|index")."""
    return run_hash(farm, state_keys.SAMPLES)[key].split("|")[3]


def _identity(farm: LocalFarm) -> str:
    return generation_identity(farm.settings())


def _kept(farm: LocalFarm, keys: list[str]) -> dict[str, int]:
    """Each sample's turns recorded on disk now."""
    return {k: len(gen.load(farm.output_dir, farm.run_id(), k, _sha(farm, k), _identity(farm)
                            ).turns) for k in keys}


def _check_point(farm: LocalFarm, keys: list[str], log: Path) -> tuple[int, dict[str, int]]:
    """The turns recorded now, then the server log's end: a turn's log line is written before
    its answer leaves the server, so every recorded turn's line is before that offset."""
    kept = _kept(farm, keys)
    return log.stat().st_size, kept


def test_a_server_restart_and_a_redis_that_lost_the_run_decode_no_recorded_turn_again(
        farm_factory: FarmFactory, tmp_path: Path) -> None:
    # Given a regenerating run of 6 samples of 2 to 4 user turns, its Redis's AOF saved before
    # the enqueue, and the reconciler quick
    env = {**GEN_ENV, "FARM_RECONCILE_INTERVAL_S": "2", "FARM_RECONCILE_CONFIRM_S": "2"}
    farm = farm_factory("farm", env=env, server_args=["--forward-delay-s", "0.03"])
    aof = farm.work_dir / "redis" / "appendonlydir"
    farm.start_worker("w1", concurrency=2)
    wait_until(lambda: any(aof.glob("*.incr.aof")), 10, "the AOF")
    shutil.copytree(aof, tmp_path / "aof-before")
    data = tmp_path / "multi.json"
    samples = [s for s in json.loads(EXAMPLES.read_text())
               if len(gen.reply_positions(_messages(s))) >= 2][:6]
    data.write_text(json.dumps(samples))
    assert farm.cli("enqueue", str(data), "--no-progress").returncode == 0
    keys = [str(s["id"]) for s in samples]
    index = RunIndex(farm.redis(), farm.run_id())
    log = farm.procs["server"].log
    checks: list[tuple[int, dict[str, int]]] = []  # (server log offset, turns recorded then)

    # When the server is SIGKILLed after a few turns and started again
    wait_until(lambda: _generated(index) >= 3, 120, "three regenerated turns", poll_s=0.1)
    farm.procs["server"].kill_group()
    checks.append(_check_point(farm, keys, log))
    farm.start_server(["--forward-delay-s", "0.03"])
    # And later Redis is SIGKILLed and comes back with the AOF of before the enqueue: the
    # run's index and queue are gone, and the run's reconciler enqueues its data file again
    wait_until(lambda: _generated(index) >= 6, 120, "three more turns", poll_s=0.1)
    checks.append(_check_point(farm, keys, log))
    farm.procs["redis"].kill_group()
    shutil.rmtree(aof)
    shutil.copytree(tmp_path / "aof-before", aof)
    farm.start_redis()
    wait_finished(farm, total=len(keys), timeout_s=150)

    # Then every sample is done once, and no turn recorded before either fault was asked of
    # the server after it
    assert_farm_invariants(farm, keys)
    assert "re-enqueued " in farm.procs["w1"].log.read_text()
    for offset, kept in checks:
        again = [(k, t) for k, t in _requests(log, offset) if t < kept[k]]
        assert not again, (f"recorded turns decoded again: {again}\n" + "\n".join(
            line for line in farm.procs["w1"].log.read_text().splitlines()
            if any(f" {k} " in line for k, _ in again)))
    assert sum(checks[-1][1].values()) >= 6
