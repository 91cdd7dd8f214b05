"""Two runs side by side: whatever they share (a Redis, a dump dir, a corpus, a model config),
neither takes, acknowledges, deletes or adopts anything of the other's.

Each test runs two whole farms (a reference server, an output dir and a worker each) of 20
samples and checks both ends: every sample of each run has a verified file in its own output
dir, holding its own model's states, and the runs' indexes and broker hold nothing else.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine_dump.dumpfile import DUMP_SUFFIX, T_HIDDEN
from producer.localfarm.farm import LocalFarm, wait_until
from sglang_patch.tiny_model import ensure_tiny_model
from tests.conftest import CACHE, FAST_ENV, write_samples
from tests.support.faults import text
from worker.core import checksums, tensorfile
from worker.state import keys

N = 20


@contextmanager
def two_farms(tmp_path: Path, *, b_model: str = "tiny", share_redis: bool = True,
              share_dumps: bool = False, server_args: tuple[str, ...] = (),
              env: dict[str, str] | None = None,
              b_env: dict[str, str] | None = None) -> Iterator[tuple[LocalFarm, LocalFarm]]:
    """Run A on the tiny model; run B on ``b_model``, with B's settings ``b_env``; each its
    own server, output dir and worker; one Redis when ``share_redis``, one dump dir when
    ``share_dumps`` (two servers of one host with the default FARM_DUMP_DIR)."""
    dumps = tmp_path / "shared-dumps" if share_dumps else None
    a = LocalFarm(tmp_path / "a", cache_dir=CACHE, chunked_prefill_size=128, dumps=dumps,
                  extra_env={**FAST_ENV, **(env or {})})
    b = LocalFarm(tmp_path / "b", cache_dir=CACHE, chunked_prefill_size=128, dumps=dumps,
                  model=b_model, extra_env={**FAST_ENV, **(env or {}), **(b_env or {})})
    try:
        a.start_redis()
        if share_redis:
            b.redis_url = a.env()["REDIS_URL"]
        else:
            b.start_redis()
        for farm in (a, b):
            farm.start_server(list(server_args))
        yield a, b
    finally:
        b.close(kill=True)
        a.close(kill=True)


def enqueue_both(a: LocalFarm, b: LocalFarm, data_a: Path, data_b: Path) -> None:
    for farm, data in ((a, data_a), (b, data_b)):
        res = farm.cli("enqueue", str(data), "--no-progress")
        assert res.returncode == 0, res.stdout + res.stderr


def start_workers(a: LocalFarm, b: LocalFarm) -> None:
    a.start_worker("wa", concurrency=2, wait=False)
    b.start_worker("wb", concurrency=2, wait=False)  # both at once: their work overlaps
    for farm, name in ((a, "wa"), (b, "wb")):
        wait_until(functools.partial(farm._worker_ready, farm.procs[name], 2), 120,
                   f"worker {name}")


def finals(farm: LocalFarm) -> dict[str, Path]:
    return {p.name.removesuffix(DUMP_SUFFIX): p
            for p in (farm.output_dir / "samples").rglob(f"*{DUMP_SUFFIX}")}


def _broker_idle(farm: LocalFarm) -> bool:
    r = farm.redis()
    lists = [k for k in r.scan_iter("*") if r.type(k) == b"list"
             and not k.decode().endswith(keys.MALFORMED)]
    return not any(r.llen(k) for k in lists) and r.hlen(keys.KOMBU_UNACKED) == 0


def wait_settled(a: LocalFarm, b: LocalFarm, timeout_s: float = 150) -> None:
    """Until both runs have every file, or nothing is queued, unacknowledged or running in
    either Redis for 3 s (what a run that lost samples ends as)."""
    idle_since: list[float] = []

    def settled() -> bool:
        if len(finals(a)) >= N and len(finals(b)) >= N:
            return True
        if all(_broker_idle(f) for f in (a, b)):
            idle_since.append(time.monotonic())
            return idle_since[-1] - idle_since[0] > 3
        idle_since.clear()
        return False

    wait_until(settled, timeout_s, "both runs to settle", poll_s=0.5)


def run_lists(farm: LocalFarm, name: str) -> dict[str, str]:
    """Every run's hash or list ``name`` in the farm's Redis, merged (key -> value)."""
    r = farm.redis()
    out: dict[str, str] = {}
    for k in r.scan_iter(f"{keys.PREFIX}:*:{name}"):
        if r.type(k) == b"hash":
            out.update({text(x): text(y) for x, y in r.hgetall(k).items()})
        else:
            out.update({f"{text(k)}[{i}]": text(v) for i, v in enumerate(r.lrange(k, 0, -1))})
    return out


def status(farm: LocalFarm) -> dict[str, object]:
    res = farm.cli("status", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    return dict(json.loads(res.stdout.splitlines()[-1]))


def hidden_checksum(path: Path) -> str:
    sums = json.loads(tensorfile.header_metadata(path)[checksums.M_CHECKSUMS])
    return str(sums[T_HIDDEN])


def assert_whole(farm: LocalFarm, keys_expected: list[str]) -> None:
    """Every sample of the run has its file in its own dir, and the run says so."""
    have = finals(farm)
    assert sorted(have) == sorted(keys_expected), (
        f"{farm.work_dir.name}: {len(have)} of {len(keys_expected)} files; "
        + "; ".join(f"{name} {len(got)}: {str(list(got.values())[:1])[:300]}"
                    for name in (keys.MALFORMED, keys.STALE, keys.FAILED)
                    for got in [run_lists(farm, name)]))
    st = status(farm)
    assert st["done"] == st["total"] == len(keys_expected) and st["finished"], st


def one_corpus_through_both(a: LocalFarm, b: LocalFarm, tmp_path: Path) -> list[str]:
    """``N`` samples enqueued to both runs and worked by both: each run whole (``assert_whole``).
    Returns the samples' keys."""
    data = tmp_path / "data.json"
    keys_all = [str(s["id"]) for s in write_samples(data, N)]
    enqueue_both(a, b, data, data)
    start_workers(a, b)
    wait_settled(a, b)
    assert_whole(a, keys_all)
    assert_whole(b, keys_all)
    return keys_all


def same_states(a: LocalFarm, b: LocalFarm, keys_all: list[str]) -> list[str]:
    """The samples whose hidden states are the same in both runs' files."""
    fa, fb = finals(a), finals(b)
    return [k for k in keys_all if hidden_checksum(fa[k]) == hidden_checksum(fb[k])]


@pytest.mark.parametrize("queue", ["", "shared"])
def test_two_runs_on_one_redis_keep_their_messages(tmp_path: Path, tiny_model: Path,
                                                  queue: str) -> None:
    # Given run A and run B (other settings: another fingerprint), each with its own server,
    # data file, output dir and worker, on one Redis; with FARM_QUEUE unset, and with one
    # name given to both
    env = {"FARM_QUEUE": queue} if queue else {}
    with two_farms(tmp_path, env=env, b_env={"FARM_OVERLONG": "truncate"}) as (a, b):
        data_a, data_b = tmp_path / "a.json", tmp_path / "b.json"
        keys_a = [str(s["id"]) for s in write_samples(data_a, N)]
        keys_b = [str(s["id"]) for s in write_samples(data_b, N, start=N)]
        # When both enqueue at once and both workers run
        enqueue_both(a, b, data_a, data_b)
        start_workers(a, b)
        wait_settled(a, b)
        # Then each run has all its samples, and neither refused nor adopted the other's
        assert_whole(a, keys_a)
        assert_whole(b, keys_b)
        assert not run_lists(a, keys.MALFORMED) and not run_lists(a, keys.STALE)
        # And enqueue again publishes nothing: nothing was lost
        for farm, data in ((a, data_a), (b, data_b)):
            again = farm.cli("enqueue", str(data), "--no-progress")
            assert "published: 0" in again.stdout and f"already done: {N}" in again.stdout
        if queue:  # a queue named for both: shared, said loudly, and nothing lost
            again = b.cli("enqueue", str(data_b), "--no-progress")
            assert "is shared by run" in again.stdout, again.stdout
            logs = a.procs["wa"].log.read_text() + b.procs["wb"].log.read_text()
            assert "is shared by run" in logs


def test_two_checkpoints_of_one_model_are_two_runs(tmp_path: Path, tiny_model: Path) -> None:
    # Given two checkpoints of one model (same config and tokenizer, other weights), each
    # served by its own server into its own output dir, on one Redis, with the same corpus
    other = ensure_tiny_model(CACHE, seed=1)
    with two_farms(tmp_path, b_model=str(other)) as (a, b):
        # When both enqueue it and both workers run: each run has every sample in its own dir
        keys_all = one_corpus_through_both(a, b, tmp_path)
        # Then they are two runs, each of its own model
        assert status(a)["run"] != status(b)["run"]
        same = same_states(a, b, keys_all)
        assert not same, f"files with the other checkpoint's states: {same}"


def test_two_servers_sharing_a_dump_dir_never_mix(tmp_path: Path, tiny_model: Path) -> None:
    # Given two servers of one host writing into one dump dir (the default FARM_DUMP_DIR),
    # each serving another checkpoint for a run of its own (own Redis, output dir, worker),
    # on the same corpus: both runs send the same samples at about the same time
    other = ensure_tiny_model(CACHE, seed=1)
    with two_farms(tmp_path, b_model=str(other), share_redis=False, share_dumps=True,
                   server_args=("--forward-delay-s", "0.02")) as (a, b):
        # When both workers run: no attempt was lost to the other run (a dump taken or deleted
        # by the other's worker or janitor), each run is whole
        keys_all = one_corpus_through_both(a, b, tmp_path)
        # Then each run's files hold its own model's states
        same = same_states(a, b, keys_all)
        assert not same, f"files with the other server's states: {same}"
        for farm in (a, b):
            spent = {k: int(v) for k, v in run_lists(farm, keys.ATTEMPTS).items()}
            assert spent == dict.fromkeys(keys_all, 1), f"{farm.work_dir.name}: {spent}"
