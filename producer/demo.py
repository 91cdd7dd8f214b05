"""``python -m producer demo``: the whole farm end to end on this machine, then shut down.

Uses ``REDIS_URL`` (and its TLS settings) when that Redis answers (on its own queue name) and
otherwise starts a private ``redis-server``; starts the reference server with the tiny model
and two Celery workers; runs ``python -m producer enqueue`` on the example data exactly as a
user would; shows progress until every sample has an outcome; audits every output file; prints
a summary; and stops every process it started.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import redis
from tqdm import tqdm

from producer.localfarm import LocalFarm, wait_until
from producer.status import Status, read_status
from sglang_patch.contracts import Fingerprint
from worker import broker
from worker.fingerprint import run_fingerprint
from worker.settings import Settings

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data.json"


def _redis_answers(settings: Settings | None) -> bool:
    if settings is None:
        return False
    try:
        return bool(broker.client(settings, socket_timeout_s=5, connect_timeout_s=1).ping())
    except (redis.RedisError, ValueError):
        return False


def _keeps_nothing(settings: Settings) -> bool:
    """A Redis without AOF (or whose CONFIG is disabled: assume the worst)."""
    try:
        aof = broker.client(settings).config_get("appendonly").get("appendonly")
    except redis.RedisError:
        return True
    return str(aof) != "yes"


def _redis_env(settings: Settings) -> dict[str, str]:
    """The variables that reach that Redis, for the demo's processes (which get no FARM_*)."""
    env = {"FARM_REDIS_CA_FILE": settings.redis_ca_file,
           "FARM_REDIS_CERT_FILE": settings.redis_cert_file,
           "FARM_REDIS_KEY_FILE": settings.redis_key_file,
           "FARM_ALLOW_UNAUTHENTICATED_REDIS": "1" if settings.allow_unauthenticated_redis else ""}
    return {k: v for k, v in env.items() if v}


def _step(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def run_demo(work_dir: Path, data: Path, workers: int = 2, concurrency: int = 2,
             redis: Settings | None = None) -> int:
    """Returns 0 when every sample is done or rejected and every file audits whole."""
    shutil.rmtree(work_dir / "out", ignore_errors=True)
    shutil.rmtree(work_dir / "dumps", ignore_errors=True)
    shared = redis if redis is not None and _redis_answers(redis) else None
    volatile = shared is not None and _keeps_nothing(shared)
    env = {**({"FARM_ALLOW_VOLATILE_REDIS": "1"} if volatile else {}),
           **(_redis_env(shared) if shared else {})}
    farm = LocalFarm(work_dir, redis_url=shared.redis_url if shared else None, extra_env=env)
    t_start = time.monotonic()
    try:
        if shared:
            _step(f"using the Redis at {broker.where(shared)} (the demo's run has keys and a "
                  "queue of its own)")
            if volatile:
                _step("that Redis keeps nothing on disk: fine for a demo (allowed with "
                      "FARM_ALLOW_VOLATILE_REDIS=1); a real run refuses it, use "
                      "ops/start-redis.sh")
        else:
            farm.start_redis()
            _step(f"started a private redis-server on port {farm.redis_port} (AOF always)")
        farm.start_server()
        _step(f"reference server (tiny model) on port {farm.server_port}, dumps in "
              f"{farm.dump_dir}")
        for i in range(workers):
            farm.start_worker(f"demo{i + 1}", concurrency=concurrency)
        _step(f"{workers} celery workers x {concurrency} processes ready; logs in "
              f"{work_dir / 'logs'} (tail -f {work_dir / 'logs' / 'demo1.log'})")
        settings = farm.settings()
        _, fp = run_fingerprint(settings)
        t0 = time.monotonic()
        _step(f"python -m producer enqueue {data}")
        res = farm.cli("enqueue", str(data), "--no-progress")
        print(res.stdout + res.stderr, end="", flush=True)
        if res.returncode == 2:
            return 1
        status = _follow(settings, fp)
        elapsed = time.monotonic() - t0
        _step("python -m producer audit")
        audit = farm.cli("audit")
        print(audit.stdout + audit.stderr, end="", flush=True)
        _summary(status, elapsed, time.monotonic() - t_start)
        finished = status.finished and status.failed == 0
        return 0 if finished and audit.returncode == 0 else 1
    finally:
        farm.close()
        left = [p.name for p in farm.procs.values() if p.alive()]
        _step("stopped everything" + (f"; STILL RUNNING: {left}" if left else ""))


def _follow(settings: Settings, fp: Fingerprint, timeout_s: float = 1800) -> Status:
    """Show progress until every sample has an outcome and nothing is in flight."""
    st = read_status(settings, fp)
    bar = tqdm(total=st.total, unit="sample", desc="extract", file=sys.stdout)

    def finished() -> bool:
        nonlocal st
        st = read_status(settings, fp)
        bar.update(st.done + st.rejected + st.failed - bar.n)
        return st.finished

    try:
        wait_until(finished, timeout_s, "the run to finish", poll_s=0.25)
    finally:
        bar.close()
    return st


def _summary(st: Status, extract_s: float, wall_s: float) -> None:
    _step("summary")
    print(f"samples done:     {st.done}\n"
          f"samples rejected: {st.rejected}\n"
          f"samples failed:   {st.failed}\n"
          f"tokens:           {st.tokens}\n"
          f"bytes written:    {st.bytes / 1e6:.1f} MB\n"
          f"throughput:       {st.done / extract_s:.1f} samples/s "
          f"({extract_s:.1f}s from enqueue to last file)\n"
          f"demo wall time:   {wall_s:.1f}s", flush=True)


def main_demo(work_dir: Path | None, data: Path | None, settings: Settings) -> int:
    work = work_dir or Path(os.getcwd()) / "demo-out"
    return run_demo(work, data or EXAMPLES, redis=settings)
