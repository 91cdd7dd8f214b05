"""``python -m producer demo``: the whole farm end to end on this machine, then shut down.

Uses ``REDIS_URL``'s Redis when it answers (on its own queue name), else a private
``redis-server``, never the default URL's, which may be someone else's. Starts the reference
server and two workers, runs ``enqueue`` exactly as a user would, waits for every outcome,
audits every file, stops what it started and prints the commands that look at its run.
Test: tests/farm/test_demo.py::test_the_demo_keeps_to_its_own_redis_and_its_printed_commands_work.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from engine_dump.fingerprint import Fingerprint
from producer.localfarm.farm import LocalFarm, wait_until
from producer.status import Status, read_status
from worker.core import manifest as manifests
from worker.core import run as runs
from worker.core.errors import ConfigError, Transient
from worker.core.settings import Settings
from worker.server.fingerprint import run_fingerprint
from worker.state import broker
from worker.state.broker import SettingsHidden

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data.json"


def _redis_answers(settings: Settings | None) -> bool:
    return settings is not None and broker.answers(settings)


def _keeps_nothing(settings: Settings) -> bool:
    """A Redis without AOF (or whose CONFIG is disabled: assume the worst)."""
    try:
        aof = broker.config(broker.client(settings), ["appendonly"]).get("appendonly")
    except (Transient, SettingsHidden):
        return True
    return aof != "yes"


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
             redis: Settings | None = None, store_dtype: str = "bf16") -> int:
    """Returns 0 when every sample is done or rejected and every file audits whole.

    ``redis``: the settings of a Redis to share (the environment named one), else None: a
    private one. ``store_dtype``: FARM_STORE_DTYPE of the run (server and workers).
    """
    shutil.rmtree(work_dir / "out", ignore_errors=True)
    shutil.rmtree(work_dir / "dumps", ignore_errors=True)
    shared = redis if redis is not None and _redis_answers(redis) else None
    if shared is None:  # the previous demo's private Redis held only its run, now removed
        shutil.rmtree(work_dir / "redis", ignore_errors=True)
    volatile = shared is not None and _keeps_nothing(shared)
    env = {"FARM_STORE_DTYPE": store_dtype,
           **({"FARM_ALLOW_VOLATILE_REDIS": "1"} if volatile else {}),
           **(_redis_env(shared) if shared else {})}
    farm = LocalFarm(work_dir, redis_url=shared.redis_url if shared else None, extra_env=env)
    if redis is not None and shared is None:
        _step(f"the Redis at {broker.where(redis)} (REDIS_URL) does not answer: the demo "
              "starts a private one")
    try:
        rc = _run(farm, data, workers, concurrency, shared, volatile)
    finally:
        farm.close()
        left = [p.name for p in farm.procs.values() if p.alive()]
        _step("stopped everything" + (f"; STILL RUNNING: {left}" if left else ""))
    if runs.read_run_id(farm.output_dir) is not None:
        _step("look at the run with these commands (from this directory; nothing of the "
              "demo runs now):")
        print("\n".join(f"    {line}" for line in look_commands(farm, shared)), flush=True)
    return rc


def _run(farm: LocalFarm, data: Path, workers: int, concurrency: int,
         shared: Settings | None, volatile: bool) -> int:
    t_start = time.monotonic()
    if shared:
        _step(f"using the Redis at {broker.where(shared)} (REDIS_URL; the demo's run has keys "
              "and a queue of its own)")
        if volatile:
            _step("that Redis keeps nothing on disk: fine for a demo (allowed with "
                  "FARM_ALLOW_VOLATILE_REDIS=1); a real run refuses it, use "
                  "ops/start-redis.sh")
    else:
        farm.start_redis()
        _step(f"started a private redis-server on port {farm.redis_port} (AOF always; "
              "REDIS_URL is not set)")
    settings = farm.settings()
    farm.start_server(["--dump-dtype", settings.hidden_dtype])
    _step(f"reference server (tiny model, storing {settings.hidden_dtype}) on port "
          f"{farm.server_port}, dumps in {farm.dump_dir}")
    logs = Path(_shown(farm.work_dir / "logs"))
    for i in range(workers):
        farm.start_worker(f"demo{i + 1}", concurrency=concurrency)
    _step(f"{workers} celery workers x {concurrency} processes ready; logs in "
          f"{logs} (tail -f {logs / 'demo1.log'})")
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
    audit = farm.cli("audit", "--no-progress")
    print(audit.stdout + audit.stderr, end="", flush=True)
    _summary(status, elapsed, time.monotonic() - t_start)
    finished = status.finished and status.failed == 0
    return 0 if finished and audit.returncode == 0 else 1


def _shown(path: Path) -> str:
    """``path`` as typed from the current directory: relative below it, else absolute."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def look_commands(farm: LocalFarm, shared: Settings | None) -> list[str]:
    """Shell lines that look at the demo's run once it has stopped (status, audit, export,
    dashboard), as typed from the current directory: the private Redis restarted from its
    files first, and every setting the commands need exported."""
    py = _shown(Path(sys.executable))
    lines, env = [], {}
    if shared is None:
        lines.append(shlex.join(["redis-server", "--port", str(farm.redis_port), "--bind",
                                 "127.0.0.1", "--dir", _shown(farm.work_dir / "redis"),
                                 "--appendonly", "yes", "--daemonize", "yes"])
                     + "   # the demo's Redis again, from its files")
        env["REDIS_URL"] = farm.env()["REDIS_URL"]
    env.update(FARM_OUTPUT_DIR=_shown(farm.output_dir), FARM_DUMP_DIR=_shown(farm.dump_dir))
    model = _model_path(farm.output_dir)
    if model:  # audit tokenizes the records again (the server is stopped)
        env["FARM_MODEL_PATH"] = model
    lines.append("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
    lines += [f"{py} -m producer status",
              f"{py} -m producer audit",
              f"{py} -m producer export --to specforge "
              f"{shlex.quote(_shown(farm.work_dir / 'specforge'))}",
              f"{py} -m producer dashboard --no-auth   # then open http://127.0.0.1:5556/ "
              "(Ctrl-C stops it)"]
    if shared is None:
        lines.append(f"redis-cli -p {farm.redis_port} shutdown   # when you are done")
    return lines


def _model_path(out_dir: Path) -> str:
    """The model path the run's manifest records ("" when it does not)."""
    try:
        return manifests.model_path(manifests.read(out_dir))
    except (OSError, ConfigError):
        return ""


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


def main_demo(work_dir: Path | None, data: Path | None, redis: Settings | None,
              store_dtype: str = "bf16") -> int:
    """``redis``: the settings when the environment names a Redis to share, else None."""
    work = work_dir or Path(os.getcwd()) / "demo-out"
    return run_demo(work, data or EXAMPLES, redis=redis, store_dtype=store_dtype)
