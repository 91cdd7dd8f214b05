"""The hosts of one run (worker/state/hosts.py) against a real Redis and real output dirs:
what each host holds, a host's files registered after Redis lost them, a file held twice, and
the hosts an output dir remembers when Redis forgot them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS, T_LOSS_MASK, TMP_MARK, is_temp_name
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from worker.core import outdir
from worker.core.finalfile import M_CONTENT
from worker.core.settings import Settings
from worker.core.store import OutputStore, Part
from worker.state import hosts
from worker.state.index import RunIndex

H = 4
DOWN = Settings(server_url="http://127.0.0.1:1")  # no server: its state is "down (...)"


def _fp(hidden_size: int = H) -> Fingerprint:
    return Fingerprint(config_sha256="a", tokenizer_sha256="b", chat_template_sha256="c",
                       layers_to_capture=(2, 4, 5), layer_convention=LAYER_CONVENTION,
                       hidden_size=hidden_size, dtype="bfloat16", max_tokens=8192,
                       overlong="reject")


def _parts(n: int, seed: int, h: int = H) -> dict[str, Part]:
    rng = np.random.default_rng(seed)
    arrays: dict[str, tuple[str, np.ndarray]] = {
              T_INPUT_IDS: ("I64", np.arange(n, dtype=np.int64)),
              T_LOSS_MASK: ("I64", np.ones(n, dtype=np.int64)),
              T_HIDDEN: ("BF16", rng.integers(0, 0x3F00, (n, h), dtype=np.uint16)),
              T_AUX: ("BF16", rng.integers(0, 0x3F00, (n, 3 * h), dtype=np.uint16))}
    return {k: Part.from_array(dt, a) for k, (dt, a) in arrays.items()}


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _output(root: Path, keys_and_content: dict[str, str]) -> tuple[OutputStore, str]:
    """An output dir of the run holding these samples' final files; (store, run id)."""
    store = OutputStore(root, _fp()).open()
    for i, (key, content) in enumerate(keys_and_content.items()):
        store.write(key, _parts(3 + i, i), {M_CONTENT: content})
    return store, store.run_id


def test_scan_reads_every_final_file_of_the_run_and_nothing_else(tmp_path: Path) -> None:
    # Given an output dir with three samples, a temp file, and a file of another run
    store, _ = _output(tmp_path, {"a": "ha", "b": "hb", "c.tmp.x": "hc"})
    shard = store.final_path("zz").parent
    shard.mkdir(parents=True, exist_ok=True)
    (shard / f".zz.safetensors{TMP_MARK}host.m1.1.abcd").write_bytes(b"partial")
    other = OutputStore(tmp_path / "other", _fp(hidden_size=8)).open()
    foreign = other.write("f", _parts(3, 9, h=8), {M_CONTENT: "hf"})
    foreign.rename(shard / foreign.name)
    # When it is scanned for the run, Then each of its files is held with its content and size
    held = {h.key: h for h in hosts.scan(tmp_path, store.fingerprint.id)}
    assert sorted(held) == ["a", "b", "c.tmp.x"]
    assert held["b"].sha256 == "hb" and held["b"].tokens == 4
    assert held["a"].size_bytes == store.final_path("a").stat().st_size
    # And another run's id finds nothing
    assert list(hosts.scan(tmp_path, "0" * 16)) == []


def test_register_makes_a_hosts_files_done_again_after_redis_lost_them(
        r: redis.Redis, tmp_path: Path) -> None:
    # Given an output dir whose samples the run's Redis no longer knows as done
    store, run_id = _output(tmp_path, {"a": "ha", "b": "hb"})
    index = RunIndex(r, run_id)
    index.mark_done("a", 10, 3)
    # When the host registers its files
    reg = hosts.register(r, run_id, "hostA", tmp_path, store.fingerprint.id, DOWN)
    # Then both are done and held by it, one relearnt; its entry says it was heard from
    assert (reg.files, reg.relearnt, reg.twice, reg.set_aside) == (2, 1, 0, 0)
    assert index.are_done(["a", "b"]) == [True, True]
    assert hosts.holders(r, run_id, ["a", "b", "c"]) == [("hostA", "ha"), ("hostA", "hb"), None]
    assert hosts.held_counts(r, run_id) == {"hostA": 2}
    e = hosts.entry(r, run_id, "hostA")
    assert e is not None and e["files"] == 2 and "registered_at" in e
    assert e["server"].startswith("down") and e["output_dir"] == str(tmp_path)
    # And the output dir remembers the host, in case Redis loses the run again
    assert hosts.read_known(tmp_path) == {"hostA": {"output_dir": str(tmp_path),
                                                     "root_id": hosts.root_id(tmp_path)}}


def test_a_file_done_on_another_host_is_set_aside_here_not_deleted(
        r: redis.Redis, tmp_path: Path) -> None:
    # Given a sample done on host B (its record's content hb), and host A's output dir that
    # also holds it (A was lost after writing it, before the run learnt so)
    store_a, run_id = _output(tmp_path / "a", {"x": "hx", "y": "hy"})
    _output(tmp_path / "b", {"x": "hx"})
    hosts.register(r, run_id, "hostB", tmp_path / "b", store_a.fingerprint.id, DOWN)
    # When host A registers
    reg = hosts.register(r, run_id, "hostA", tmp_path / "a", store_a.fingerprint.id, DOWN)
    # Then A's copy of x leaves its training set for done-elsewhere/, kept; y is A's
    assert (reg.files, reg.twice, reg.set_aside) == (1, 1, 1)
    assert not store_a.final_path("x").exists()
    assert (tmp_path / "a" / outdir.DONE_ELSEWHERE_DIR / "x.safetensors").exists()
    twice = hosts.held_twice(r, run_id)["x"]
    assert twice["hosts"] == ["hostA", "hostB"] and twice["kept"] == "hostB"
    assert hosts.holders(r, run_id, ["x", "y"]) == [("hostB", "hx"), ("hostA", "hy")]


def test_hosts_sharing_one_output_dir_hold_its_files_once(r: redis.Redis,
                                                         tmp_path: Path) -> None:
    # Given one output dir (a shared mount) registered by one host, then by a second one
    # that the run has never heard of (its first start: no entry yet)
    store, run_id = _output(tmp_path, {"a": "ha"})
    hosts.register(r, run_id, "hostA", tmp_path, store.fingerprint.id, DOWN)
    reg = hosts.register(r, run_id, "hostB", tmp_path, store.fingerprint.id, DOWN)
    # Then they are the same output, nothing is held twice, and the file stays in the
    # training set (it was moved to done-elsewhere/ as a second copy of itself)
    assert hosts.same_output(r, run_id, "hostA", "hostB")
    assert (reg.twice, reg.set_aside) == (0, 0) and hosts.held_twice(r, run_id) == {}
    assert store.final_path("a").exists()
    assert not (tmp_path / outdir.DONE_ELSEWHERE_DIR).exists()


def test_the_root_id_is_made_once_and_kept(tmp_path: Path) -> None:
    first = hosts.root_id(tmp_path)
    assert len(first) == 16 and hosts.root_id(tmp_path) == first
    assert not [p for p in tmp_path.iterdir() if is_temp_name(p.name)]
    (tmp_path / "other").mkdir()
    assert hosts.root_id(tmp_path / "other") != first


def test_claim_keeps_the_first_holder(r: redis.Redis) -> None:
    hosts.claim(r, "1" * 16, "hostA", {"a": "ha", "b": "hb"})
    hosts.claim(r, "1" * 16, "hostB", {"b": "other", "c": "hc"})
    assert hosts.holders(r, "1" * 16, ["a", "b", "c"]) == [
        ("hostA", "ha"), ("hostA", "hb"), ("hostB", "hc")]
    assert hosts.held_counts(r, "1" * 16) == {"hostA": 2, "hostB": 1}
    assert hosts.holders(r, "1" * 16, []) == []


def test_a_beat_refreshes_the_entry_and_a_clean_stop_shows_until_the_next_beat(
        r: redis.Redis, tmp_path: Path) -> None:
    run_id = "2" * 16
    # Given a host that never registered: its beat says so (the caller registers its files)
    assert hosts.beat(r, run_id, "hostA", tmp_path, DOWN) is False
    assert hosts.beat(r, run_id, "hostA", tmp_path, DOWN, registered_files=0) is True
    before = hosts.entry(r, run_id, "hostA")
    assert before is not None
    # When its workers stop cleanly, Then it shows as stopped; a new beat clears that
    hosts.mark_stopped(r, run_id, "hostA")
    assert "stopped_at" in (hosts.entry(r, run_id, "hostA") or {})
    assert hosts.beat(r, run_id, "hostA", tmp_path, DOWN) is True
    after = hosts.entry(r, run_id, "hostA") or {}
    assert "stopped_at" not in after and after["at"] >= before["at"]
    hosts.mark_stopped(r, run_id, "nobody")  # an unknown host: nothing to mark
    assert list(hosts.hosts(r, run_id)) == ["hostA"]


def test_an_output_dir_remembers_the_hosts_redis_forgot(r: redis.Redis, tmp_path: Path) -> None:
    run_id = "3" * 16
    # Given two hosts registered, then a Redis that lost everything
    for host in ("hostA", "hostB"):
        (tmp_path / host).mkdir()
        hosts.beat(r, run_id, host, tmp_path / host, DOWN, registered_files=0)
    hosts.remember_hosts(r, run_id, tmp_path)
    r.flushall()
    # Then the output dir names both as unheard until they register again
    assert sorted(hosts.unheard(r, run_id, tmp_path)) == ["hostA", "hostB"]
    hosts.beat(r, run_id, "hostA", tmp_path / "hostA", DOWN, registered_files=0)
    assert list(hosts.unheard(r, run_id, tmp_path)) == ["hostB"]
    # And a host forgotten on purpose (its samples redone) is no longer named
    hosts.forget_hosts(tmp_path, ["hostB"])
    assert hosts.unheard(r, run_id, tmp_path) == {}
    assert list(json.loads((tmp_path / outdir.HOSTS_JSON).read_text())) == ["hostA"]
