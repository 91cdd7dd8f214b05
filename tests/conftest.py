"""Shared fixtures: the tiny model, a private Redis, and whole local farms of real processes.

Nothing here mocks Redis, Celery, HTTP or files: farms are real ``redis-server``,
``celery worker`` and reference-server processes on loopback ports, in a temp dir.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_dump.dumpfile import DUMP_SUFFIX, READY_PREFIX, is_temp_name
from producer.localfarm import farm as localfarm
from producer.localfarm.farm import LocalFarm, wait_until
from sglang_patch.tiny_model import ensure_tiny_model
from tests.support.forkserver import ForkServer

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


def pytest_configure(config: pytest.Config) -> None:
    # Reference servers fork from one process that imported torch and transformers once
    # (tests/support/forkserver.py: ~6 s of CPU a start saved, ~100 starts); 0: plain starts.
    if os.environ.get("HSFARM_TEST_FORKSERVER", "1") != "0":
        localfarm.launcher = ForkServer()


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


def write_samples(path: Path, n: int, start: int = 0,
                  max_chars: int | None = None) -> list[dict[str, object]]:
    """The first ``n`` example samples (from ``start``; of those at most ``max_chars`` long as
    JSON, when given) as a JSON array file."""
    samples = json.loads(EXAMPLES.read_text())
    if max_chars is not None:
        samples = [s for s in samples if len(json.dumps(s, ensure_ascii=False)) <= max_chars]
    samples = samples[start : start + n]
    path.write_text(json.dumps(samples, ensure_ascii=False))
    return samples


@contextlib.contextmanager
def served_farm(root: Path, chunked_prefill_size: int = 256, *, model: str = "tiny",
                dumps: Path | None = None, env: dict[str, str] | None = None,
                server_args: list[str] | None = None, redis: bool = True,
                workers: tuple[str, ...] = ()) -> Iterator[LocalFarm]:
    """A farm in ``root``: a private Redis (AOF always; ``redis=False``: the test starts its
    own), the reference server (``server_args``: its flags) and ``workers`` (2 processes
    each), with ``FAST_ENV`` and ``env``; every process killed after. The one place the tests
    build a farm, so each starts and tears down the same way."""
    f = LocalFarm(root, model=model, cache_dir=CACHE, chunked_prefill_size=chunked_prefill_size,
                  dumps=dumps, extra_env={**FAST_ENV, **(env or {})})
    try:
        if redis:
            f.start_redis()
        f.start_server(server_args)
        for name in workers:
            f.start_worker(name, concurrency=2)
        yield f
    finally:
        f.close(kill=True)


@contextlib.contextmanager
def private_redis(root: Path) -> Iterator[LocalFarm]:
    """A private redis-server in ``root`` (AOF always, as the broker's) and nothing else,
    killed after: the state tier's Redis and that of tests needing only a broker."""
    farm = LocalFarm(root, cache_dir=CACHE)
    try:
        farm.start_redis()
        yield farm
    finally:
        farm.close(kill=True)


FarmFactory = Callable[..., LocalFarm]
LOG_TAIL_LINES = 40
_FARMS = pytest.StashKey[list[LocalFarm]]()  # a test's farms, for its report if it fails


def _factory(stack: contextlib.ExitStack, root: Callable[[str], Path],
             made: list[LocalFarm] | None = None) -> FarmFactory:
    def make(name: str = "farm", **options: Any) -> LocalFarm:
        farm = stack.enter_context(served_farm(root(name), **options))
        if made is not None:
            made.append(farm)
        return farm
    return make


@pytest.fixture
def farm_factory(request: pytest.FixtureRequest, tmp_path: Path,
                 tiny_model: Path) -> Iterator[FarmFactory]:
    """``farm_factory(name, **options)``: a ``served_farm`` in this test's temp dir, torn down
    after the test; if the test fails, its report shows each farm process's state and log."""
    made: list[LocalFarm] = []
    request.node.stash[_FARMS] = made
    with contextlib.ExitStack() as stack:
        yield _factory(stack, lambda name: tmp_path / name, made)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed farm test's report carries what its processes did: a farm's logs are in a temp
    dir that CI does not keep, and a timeout's traceback says only what the test waited for."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call" and report.failed:
        for farm in item.stash.get(_FARMS, []):
            for name, proc in farm.procs.items():
                report.sections.append((f"farm {farm.work_dir.name}: {name}", _proc_report(proc)))


def _proc_report(proc: localfarm.Proc) -> str:
    """A farm process's state now (running, or its exit status) and its log's last lines."""
    state = "never started"
    if proc.popen is not None:
        code = proc.popen.poll()
        state = f"pid {proc.pid} " + ("running" if code is None else f"exited with {code}")
    try:
        lines = proc.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError as e:
        lines = [f"(no log: {e})"]
    return "\n".join([f"{' '.join(proc.argv[:4])} ...: {state}; {proc.log}:", *lines])


@pytest.fixture(scope="module")
def module_farm_factory(tmp_path_factory: pytest.TempPathFactory,
                        tiny_model: Path) -> Iterator[FarmFactory]:
    """``farm_factory`` for a module's shared farm, torn down after the module's tests."""
    with contextlib.ExitStack() as stack:
        yield _factory(stack, lambda name: tmp_path_factory.mktemp(name) / "farm")


@pytest.fixture
def farm(farm_factory: FarmFactory) -> LocalFarm:
    """A private Redis (AOF always) and the reference server; tests start their workers."""
    return farm_factory("farm")


def wait_finished(farm: LocalFarm, total: int, timeout_s: float = 240) -> None:
    """Until every sample is done/rejected/failed and the broker holds nothing."""
    from worker.state.queue_scan import broker_depth

    r = farm.redis()
    queue = farm.queue()

    def finished() -> bool:
        return sum(farm.outcomes()) >= total and broker_depth(r, queue) == (0, 0)

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
    temps = [p for p in out.rglob("*") if is_temp_name(p.name)]
    assert not temps, f"temp files left: {temps}"
    assert sorted(names) == sorted(f"{k}{DUMP_SUFFIX}" for k in keys_expected), (
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
                if p.is_file() and not p.name.startswith(READY_PREFIX)]

    try:
        wait_until(lambda: not dumps(), 10, "the dump dir to be empty", poll_s=0.2)
    except TimeoutError:
        raise AssertionError(f"dumps left in tmpfs: {dumps()}") from None
