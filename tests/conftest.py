"""Shared fixtures: the tiny model, a private Redis, and whole local farms of real processes.

Nothing here mocks Redis, Celery, HTTP or files: farms are real ``redis-server``,
``celery worker`` and reference-server processes on loopback ports, in a temp dir.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.localfarm.farm import LocalFarm, wait_until
from sglang_patch import contracts as c
from sglang_patch.tiny_model import ensure_tiny_model

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "data.json"
CACHE = Path(os.environ.get("HSFARM_TEST_CACHE", Path.home() / ".cache" / "hsfarm"))

# Short limits so crash recovery is observable in seconds (the defaults are minutes).
FAST_ENV = {
    "FARM_DUMP_TIMEOUT_S": "8",
    "FARM_REQUEST_TIMEOUT_S": "20",
    "FARM_TASK_TIME_LIMIT_S": "20",
    "FARM_VISIBILITY_TIMEOUT_S": "25",
    "FARM_RESTORE_INTERVAL_S": "2",
    "FARM_RETRY_BACKOFF_S": "0.5",
    "FARM_RETRY_BACKOFF_MAX_S": "3",
    "FARM_JANITOR_INTERVAL_S": "1",
    "FARM_PAUSE_POLL_S": "0.5",
    "FARM_SOFT_SHUTDOWN_S": "3",
    "FARM_LOG_LEVEL": "INFO",
}


TIERS = ("unit", "state", "farm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test with its tier, the folder it is in (``-m unit``, ``-m "not farm"``)."""
    for item in items:
        parts = item.path.relative_to(ROOT).parts
        if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS:
            item.add_marker(parts[1])


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model(CACHE)


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def write_samples(path: Path, n: int, start: int = 0) -> list[dict[str, object]]:
    """The first ``n`` example samples (from ``start``) as a JSON array file."""
    samples = json.loads(EXAMPLES.read_text())[start : start + n]
    path.write_text(json.dumps(samples, ensure_ascii=False))
    return samples


@contextlib.contextmanager
def served_farm(root: Path, chunked_prefill_size: int = 256) -> Iterator[LocalFarm]:
    """A private Redis (AOF always) and the reference server in ``root``, killed after."""
    f = LocalFarm(root, cache_dir=CACHE, chunked_prefill_size=chunked_prefill_size,
                  extra_env=dict(FAST_ENV))
    try:
        f.start_redis()
        f.start_server()
        yield f
    finally:
        f.close(kill=True)


@pytest.fixture
def farm(tmp_path: Path, tiny_model: Path) -> Iterator[LocalFarm]:
    """A private Redis (AOF always) and the reference server; tests start their workers."""
    with served_farm(tmp_path / "farm") as f:
        yield f


def wait_finished(farm: LocalFarm, total: int, timeout_s: float = 240) -> None:
    """Until every sample is done/rejected/failed and the broker holds nothing."""
    from worker.state import keys
    from worker.state.queue_scan import broker_depth

    r = farm.redis()
    queue = farm.queue()

    def finished() -> bool:
        runs = [k.decode().rsplit(":", 1)[0] for k in r.scan_iter(f"{keys.PREFIX}:*:{keys.META}")]
        done = sum(int(r.zcard(f"{run}:{keys.DONE}")) for run in runs)
        outcomes = sum(int(r.hlen(f"{run}:{name}"))
                       for run in runs for name in (keys.FAILED, keys.REJECTED))
        return done + outcomes >= total and broker_depth(r, queue) == (0, 0)

    wait_until(finished, timeout_s, f"{total} samples to finish", poll_s=0.5)


def assert_farm_invariants(farm: LocalFarm, keys_expected: list[str],
                           failed: tuple[str, ...] = ()) -> None:
    """The check every fault scenario ends with: one verified file per sample, no temp or
    partial files anywhere, an empty queue and unacked set, and nothing recorded as failed but
    the samples in ``failed`` (meant to fail: no file for them)."""
    from worker.state import keys
    from worker.state.queue_scan import broker_depth

    r = farm.redis()
    recorded = {k.decode() if isinstance(k, bytes) else k
                for h in r.scan_iter(f"{keys.PREFIX}:*:{keys.FAILED}") for k in r.hkeys(h)}
    assert recorded == set(failed), f"recorded as failed: {sorted(recorded)}"

    out = farm.output_dir
    finals = sorted(p for p in (out / "samples").rglob("*") if p.is_file())
    names = [p.name for p in finals]
    temps = [p for p in out.rglob("*") if c.is_temp_name(p.name)]
    assert not temps, f"temp files left: {temps}"
    assert sorted(names) == sorted(f"{k}{c.DUMP_SUFFIX}" for k in keys_expected), (
        "not exactly one final file per sample"
    )
    assert broker_depth(farm.redis(), farm.queue()) == (0, 0)
    res = farm.cli("audit")
    assert res.returncode == (1 if failed else 0), res.stdout + res.stderr
    assert f"whole: {len(keys_expected)} " in res.stdout
    assert f"missing: {len(failed)}\n" in res.stdout and "corrupt: 0\n" in res.stdout
    # a late dump of an abandoned attempt may land after the run: the janitor removes it
    def dumps() -> list[Path]:
        return [p for p in farm.dump_dir.iterdir()  # files: the admission's slot dir stays
                if p.is_file() and not p.name.startswith(c.READY_PREFIX)]

    try:
        wait_until(lambda: not dumps(), 10, "the dump dir to be empty", poll_s=0.2)
    except TimeoutError:
        raise AssertionError(f"dumps left in tmpfs: {dumps()}") from None
