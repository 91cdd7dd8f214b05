"""``python -m producer demo``: the whole farm end to end on this machine, then shut down.

Uses ``REDIS_URL`` when that Redis answers (on its own queue name) and otherwise starts a
private ``redis-server``; starts the reference server with the tiny model and two Celery
workers; runs ``python -m producer enqueue`` on the example data exactly as a user would;
shows progress until every sample has an outcome; audits every output file; prints a summary;
and stops every process it started.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import redis
from tqdm import tqdm

from producer.localfarm import LocalFarm, wait_until
from worker import keys

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data.json"


def _redis_answers(url: str | None) -> bool:
    if not url:
        return False
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, ValueError):
        return False


def _step(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def run_demo(work_dir: Path, data: Path, workers: int = 2, concurrency: int = 2,
             redis_url: str | None = None) -> int:
    """Returns 0 when every sample is done or rejected and every file audits whole."""
    shutil.rmtree(work_dir / "out", ignore_errors=True)
    shutil.rmtree(work_dir / "dumps", ignore_errors=True)
    shared = _redis_answers(redis_url)
    farm = LocalFarm(work_dir, redis_url=redis_url if shared else None,
                     extra_env={"FARM_QUEUE": "hsfarm-demo"})
    t_start = time.monotonic()
    try:
        if shared:
            _step(f"using the Redis at {redis_url} (queue 'hsfarm-demo')")
        else:
            farm.start_redis()
            _step(f"started a private redis-server on port {farm.redis_port} (AOF always)")
        farm.start_server()
        _step(f"reference server (tiny model) on port {farm.server_port}, dumps in "
              f"{farm.dump_dir}")
        for i in range(workers):
            farm.start_worker(f"demo{i + 1}", concurrency=concurrency)
        _step(f"{workers} celery workers x {concurrency} processes ready")
        _clear_run_index(farm)
        t0 = time.monotonic()
        _step(f"python -m producer enqueue {data}")
        res = farm.cli("enqueue", str(data), "--no-progress")
        print(res.stdout + res.stderr, end="", flush=True)
        if res.returncode == 2:
            return 1
        status = _follow(farm)
        elapsed = time.monotonic() - t0
        _step("python -m producer audit")
        audit = farm.cli("audit")
        print(audit.stdout + audit.stderr, end="", flush=True)
        _summary(status, elapsed, time.monotonic() - t_start)
        finished = status["finished"] and status["failed"] == 0
        return 0 if finished and audit.returncode == 0 else 1
    finally:
        farm.close()
        left = [p.name for p in farm.procs.values() if p.alive()]
        _step("stopped everything" + (f"; STILL RUNNING: {left}" if left else ""))


def _clear_run_index(farm: LocalFarm) -> None:
    """A demo starts from nothing: drop what an earlier demo left in the run's Redis index."""
    run = _status(farm)["run"]
    r = farm.redis()
    stale = list(r.scan_iter(f"{keys.PREFIX}:{run}:*", count=1000))
    if stale:
        r.delete(*stale)


def _status(farm: LocalFarm) -> dict[str, object]:
    res = farm.cli("status", "--json")
    if res.returncode != 0:
        raise RuntimeError(f"status failed: {res.stderr}")
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def _follow(farm: LocalFarm, timeout_s: float = 1800) -> dict[str, object]:
    """Show progress until every sample has an outcome and nothing is in flight."""
    st = _status(farm)
    total = int(st["total"])  # type: ignore[call-overload]
    bar = tqdm(total=total, unit="sample", desc="extract", file=sys.stdout)

    def done() -> bool:
        nonlocal st
        st = _status(farm)
        finished = int(st["done"]) + int(st["rejected"]) + int(st["failed"])  # type: ignore[call-overload]
        bar.update(finished - bar.n)
        return bool(st["finished"])

    try:
        wait_until(done, timeout_s, "the run to finish", poll_s=1.0)
    finally:
        bar.close()
    return st


def _summary(st: dict[str, object], extract_s: float, wall_s: float) -> None:
    done = int(st["done"])  # type: ignore[call-overload]
    _step("summary")
    print(f"samples done:     {done}\n"
          f"samples rejected: {st['rejected']}\n"
          f"samples failed:   {st['failed']}\n"
          f"tokens:           {st['tokens']}\n"
          f"bytes written:    {int(st['bytes']) / 1e6:.1f} MB\n"  # type: ignore[call-overload]
          f"throughput:       {done / extract_s:.1f} samples/s "
          f"({extract_s:.1f}s from enqueue to last file)\n"
          f"demo wall time:   {wall_s:.1f}s", flush=True)


def main_demo(work_dir: Path | None, data: Path | None, redis_url: str | None) -> int:
    work = work_dir or Path(os.getcwd()) / "demo-out"
    return run_demo(work, data or EXAMPLES, redis_url=redis_url)
