"""``ops/preflight.sh`` (``python -m producer.preflight``): is this host ready for the run?

One line per check, ``OK``, ``WARN`` or ``FAIL`` and, for the last two, what to do. It reads
and asks, and changes nothing: no directory is created, no request is sent that the server
would dump. The output disk is sized to the work that remains: the run's samples without an
outcome times the average size of its files so far (from the run index). Exit code: 0 when no
line says FAIL, 1 otherwise.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from engine_dump import dumpdir, engines, nccl
from engine_dump import markers as mk
from engine_dump.dumpfile import bytes_per_token
from engine_dump.engines import Engine
from engine_dump.fingerprint import Fingerprint
from engine_dump.live_check import check_marker
from engine_dump.rids import NO_RUN
from sglang_patch.verify import sglang_missing
from worker.core import canary, dumps, outdir, weights
from worker.core import manifest as manifests
from worker.core import run as runs
from worker.core.diskio import free_bytes
from worker.core.errors import ConfigError, FarmError, Transient
from worker.core.settings import Settings
from worker.server.client import ServerClient
from worker.server.fingerprint import compute_fingerprint, resolve_model_path
from worker.state import broker
from worker.state.broker import Client, SettingsHidden
from worker.state.index import RunIndex

GiB = 1 << 30
TMPFS_TYPES = {"tmpfs", "ramfs"}
LOAD_ENV = "load the farm's environment first: set -a; . /etc/hsfarm/env; set +a"


@dataclass(frozen=True)
class Line:
    level: str  # OK, WARN or FAIL
    text: str

    def __str__(self) -> str:
        return f"{self.level:<5} {self.text}"


def ok(text: str) -> Line:
    return Line("OK", text)


def warn(text: str) -> Line:
    return Line("WARN", text)


def fail(text: str) -> Line:
    return Line("FAIL", text)


def _gib(n: float) -> str:
    """A size for a person: GiB from 1 GiB up, MB below."""
    return f"{n / GiB:,.1f} GiB" if n >= GiB else f"{n / 1e6:,.1f} MB"


def existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (what df would measure once it exists)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def fs_type(path: Path) -> str:
    """The file system type of ``path`` (from /proc/self/mounts: the longest mount prefix)."""
    target, best = str(existing(path).resolve()), ("", "?")
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return "?"
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[0]):
            best = (mount, parts[2])
    return best[1]


# --- the run: which one, and how much of it remains ------------------------------------------

@dataclass(frozen=True)
class Run:
    fingerprint: Fingerprint
    source: str  # where the fingerprint came from
    total: int = 0
    done: int = 0
    remaining: int = 0
    done_bytes: int = 0
    run_id: str = NO_RUN  # from the output dir's manifest (worker/core/run.py)


def find_run(settings: Settings, server_up: bool) -> tuple[Run | None, str]:
    """The run's fingerprint from the model (FARM_MODEL_PATH or the server) or else the
    output dir's manifest; (None, why) when neither is available."""
    if settings.model_path or server_up:
        try:
            path = resolve_model_path(settings, wait_s=0)
            return Run(compute_fingerprint(settings, path), f"model {path}",
                       run_id=runs.run_id_of(settings.output_dir)), ""
        except FarmError as e:
            return None, str(e)
    where = manifests.path(settings.output_dir)
    try:
        fp = manifests.fingerprint(manifests.read(settings.output_dir), where)
        return Run(fp, f"the manifest {where}", run_id=runs.run_id_of(settings.output_dir)), ""
    except FileNotFoundError:
        return None, ("FARM_MODEL_PATH is not set, the server does not answer and "
                      f"{where} does not exist yet")
    except ConfigError as e:
        return None, str(e)


def with_counts(run: Run, r: Client, settings: Settings) -> Run:
    run_id = runs.run_id_of(settings.output_dir)
    n = RunIndex(r, run_id).counts()
    remaining = max(n.total - n.done - n.failed - n.rejected, 0)
    return Run(run.fingerprint, run.source, n.total, n.done, remaining, n.bytes, run_id)


def check_run(run: Run | None, why: str) -> Line:
    if run is None:
        return warn(f"run: unknown ({why}); the output disk is checked against its reserve "
                    "only")
    if run.total == 0:
        return warn(f"run {run.run_id} (from {run.source}): nothing enqueued yet; "
                    "run python -m producer enqueue FILE, then preflight again to size it")
    return ok(f"run {run.run_id} (from {run.source}): {run.done} of {run.total} "
              f"samples done, {run.remaining} without an outcome")


def check_output_disk(settings: Settings, run: Run | None) -> Line:
    out = settings.output_dir
    where = existing(out)
    free = free_bytes(where)
    on = "" if where == out.absolute() else f" (not created yet; free space of {where})"
    reserve = settings.min_free_output_bytes
    if run is None or run.done == 0:
        per_token = (bytes_per_token(run.fingerprint.dtype, run.fingerprint.hidden_size) + 8
                     if run is not None else 0)  # + the loss mask
        size = (f"; each token takes {per_token:,} bytes ({per_token * 2000 / 1e6:,.0f} MB "
                "for a 2,000-token sample)") if per_token else ""
        if free < reserve:
            return fail(f"output disk {out}{on}: {_gib(free)} free, under the reserve "
                        f"FARM_MIN_FREE_OUTPUT_BYTES ({_gib(reserve)}): free space first")
        return warn(f"output disk {out}{on}: {_gib(free)} free; not sized to the run: no "
                    f"sample is done yet, so the average file size is unknown{size}; run "
                    "preflight again once some are done")
    avg = run.done_bytes / run.done
    need = int(run.remaining * avg) + reserve
    text = (f"output disk {out}{on}: {_gib(free)} free, the {run.remaining} remaining samples "
            f"need ~{_gib(need - reserve)} (average {avg / 1e6:,.1f} MB over {run.done} done) "
            f"+ the reserve of {_gib(reserve)}")
    if free >= need:
        return ok(text)
    return fail(f"{text}: {_gib(need - free)} short; grow the volume or use another "
                "FARM_OUTPUT_DIR for the rest (workers pause when it runs low)")


def check_dump_dir(settings: Settings, run: Run | None) -> list[Line]:
    d = settings.dump_dir
    where = existing(d)
    on = "" if where == d.absolute() else f" (not created yet: the server makes it; {where})"
    free = free_bytes(where)
    need = settings.min_free_dump_bytes
    one = ""
    if run is not None:  # one dump of the longest sample must fit
        longest = settings.max_tokens * (8 * run.fingerprint.hidden_size + 8)
        need += longest
        one = f" (one {settings.max_tokens}-token dump: {_gib(longest)}, + the reserve)"
    space = (ok if free >= need else fail)(
        f"dump dir {d}{on}: {_gib(free)} free, needs {_gib(need)}{one}"
        + ("" if free >= need else "; Docker's default /dev/shm is 64 MB: set shm_size"))
    kind = fs_type(d)
    tmpfs = (ok(f"dump dir is on {kind} (RAM)") if kind in TMPFS_TYPES else
             fail(f"dump dir {d} is on {kind}, not tmpfs: every dump would hit a disk twice; "
                  "use a directory under /dev/shm"))
    return [space, tmpfs, check_dump_dir_owner(d)]


def check_dump_dir_owner(d: Path) -> Line:
    """The dump dir is this user's (or root's) and no one else can write to it (``dumpdir``)."""
    if not os.path.lexists(d):
        return ok(f"dump dir {d} does not exist yet: the server creates it 0700")
    why = dumpdir.problem(d)
    if why:
        return fail(why)
    st = d.stat()
    return ok(f"dump dir {d}: owner uid {st.st_uid}, mode {st.st_mode & 0o7777:04o}, no one "
              "else can write to it")


# --- services ----------------------------------------------------------------------------------

def check_redis(settings: Settings, env_loaded: bool) -> tuple[Line, Client | None]:
    where = broker.where(settings)
    try:
        allowed = broker.check_auth(settings)
        r = broker.client(settings, socket_timeout_s=5, connect_timeout_s=3)
    except ConfigError as e:
        return fail(f"redis: {e}"), None
    try:
        broker.ping(r)
        cfg = broker.config(r, ["appendonly", "appendfsync", "maxmemory-policy"])
    except SettingsHidden as e:
        return warn(f"redis at {where} answers, but its settings cannot be read ({e}); make "
                    "sure it runs with appendonly yes, appendfsync always, noeviction"), r
    except Transient as e:
        hint = "" if env_loaded else f"; REDIS_URL is not set: {LOAD_ENV}"
        # redis-py's own words ("Error 111 connecting to ..."): the line already names Redis
        why = e.__cause__ if e.__cause__ is not None else e
        return fail(f"redis at {where}: {why}: start it (systemctl start hsfarm-redis) or fix "
                    f"REDIS_URL{hint}"), None
    want = {"appendonly": "yes", "appendfsync": "always", "maxmemory-policy": "noeviction"}
    wrong = {k: cfg.get(k) for k, v in want.items() if cfg.get(k) != v}
    loss = broker.replay_loss(r)
    if loss:
        return fail(f"redis at {where} {loss}"), r
    if allowed and not wrong:
        return warn(f"redis at {where}: AOF always, noeviction; {allowed}"), r
    if not wrong:
        return ok(f"redis at {where}: AOF always, noeviction"), r
    text = f"redis at {where}: {wrong}, wanted {want}: start it with ops/start-redis.sh"
    if settings.allow_volatile_redis and set(wrong) <= {"appendonly", "appendfsync"}:
        return warn(f"{text} (accepted: FARM_ALLOW_VOLATILE_REDIS=1; a restart loses the "
                    "queue)"), r
    return fail(text), r


def check_server(settings: Settings) -> tuple[Line, Engine | None]:
    """The server's line, and its engine (None when it does not answer)."""
    async def ask() -> Engine:
        client = ServerClient.of(settings, 5.0)
        try:
            return await client.engine(5.0)
        finally:
            await client.close()

    try:
        engine = asyncio.run(ask())
    except FarmError as e:
        return fail(f"server at {settings.server_url} does not answer ({e}): start it "
                    "(systemctl start hsfarm-sglang, ops/launch-sglang.sh or "
                    "ops/launch-vllm.sh) or fix FARM_SERVER_URL"), None
    return ok(f"server at {settings.server_url}: {engine.describe()}"), engine


def check_hook(settings: Settings, engine: Engine | None) -> Line:
    """The hook's ready marker; ``engine`` names the variable in the fix (SGLang's when the
    server does not answer)."""
    variable = (engine or engines.sglang_engine({})).dump_dir_variable
    if not settings.dump_dir.is_dir():
        return fail(f"ready marker: no dump dir {settings.dump_dir}: the hook creates it when "
                    f"the server starts with {variable}={settings.dump_dir}")
    result = check_marker(settings.dump_dir, max_age_s=3600, env=variable)
    if not result.ok:
        return fail(f"{result.name}: {result.detail}")
    why = dumps.served_dtype_problem(settings.dump_dir, settings.hidden_dtype)
    return fail(f"{result.name}: {why}") if why else ok(f"{result.name}: {result.detail}")


# --- this host: GPUs and the SGLang plugin ----------------------------------------------------

def _unit_of(pid: int) -> str:
    """The systemd unit (or container scope) a process runs in, from its cgroup."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return "?"
    for line in lines:
        for part in reversed(line.split(":", 2)[-1].split("/")):
            if part.endswith((".service", ".scope")):
                return part
    return "no systemd unit"


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _smi(smi: str, query: str, what: str) -> list[list[str]]:
    out = subprocess.run([smi, f"--query-{query}={what}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError((out.stderr or out.stdout).strip().splitlines()[-1:] or "failed")
    return [[f.strip() for f in row.split(",")] for row in out.stdout.splitlines() if row.strip()]


def check_gpus() -> Line:
    """Which GPUs this host has, and who holds them (process, command, systemd unit)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return warn("GPUs: none on this host (no nvidia-smi, no NVIDIA driver): nothing to "
                    "check; SGLang needs the GPUs of the host it runs on (fine for the CPU "
                    "reference server)")
    try:
        gpus = _smi(smi, "gpu", "index,uuid,name,memory.used")
        apps = _smi(smi, "compute-apps", "gpu_uuid,pid,process_name,used_memory")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return fail(f"GPUs: nvidia-smi failed ({e}): is the driver loaded?")
    names = {g[1]: g[0] for g in gpus if len(g) > 1}
    holders: dict[int, set[str]] = {}
    for app in apps:
        if len(app) > 1 and app[1].isdigit():
            holders.setdefault(int(app[1]), set()).add(names.get(app[0], "?"))
    model = gpus[0][2] if gpus and len(gpus[0]) > 2 else "?"
    if not holders:
        used = [g[0] for g in gpus if len(g) > 3 and g[3].isdigit() and int(g[3]) > 1024]
        if used:
            return warn(f"GPUs: {len(gpus)} x {model}; memory in use on GPU {','.join(used)} "
                        "but no process visible (another container?)")
        return ok(f"GPUs: {len(gpus)} x {model}, none in use")
    who, foreign = [], []
    for pid, held in sorted(holders.items()):
        cmd, unit = _cmdline(pid), _unit_of(pid)
        ours = "sglang" in cmd
        who.append(f"GPU {','.join(sorted(held))}: pid {pid} ({cmd[:60] or '?'}; {unit})"
                   + ("" if ours else " NOT the farm's server"))
        if not ours:
            foreign.append(unit)
    text = f"GPUs: {len(gpus)} x {model}; " + "; ".join(who)
    if not foreign:
        return ok(text)
    stop = ", ".join(sorted({u for u in foreign if u.endswith(".service")})) or "them"
    return fail(f"{text}: stop {stop} (systemctl disable --now UNIT; see ops/RUNBOOK.md, "
                "'GPUs held')")


def check_plugin(sglang_python: str | None) -> list[Line]:
    """The install checks of ``python -m sglang_patch verify`` with SGLang's python: the
    one given, or this one when SGLang is installed here; else a line saying they did not
    run."""
    python = sglang_python or sys.executable
    if not sglang_python:
        missing = sglang_missing()
        if missing is not None:
            return [warn(f"plugin checks NOT run: SGLang is not installed in this python "
                         f"({sys.executable}); run them with the server's: SGLANG_PYTHON="
                         "/path/to/sglang/bin/python ops/preflight.sh, or that python -m "
                         "sglang_patch verify")]
    try:
        res = subprocess.run([python, "-m", "sglang_patch", "verify"], capture_output=True,
                             text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [fail(f"plugin checks: cannot run {python} -m sglang_patch verify ({e})")]
    lines = [ok(x[6:]) if x.startswith("PASS  ") else fail(x[6:]) if x.startswith("FAIL  ")
             else warn(x) for x in res.stdout.splitlines() if x.strip()]
    if not lines:
        err = (res.stderr.strip().splitlines() or ["no output"])[-1]
        lines = [fail(f"plugin checks: {python} -m sglang_patch verify: {err}")]
    return lines


# --- the whole check ---------------------------------------------------------------------------

def check_weights(settings: Settings) -> Line:
    """The checkpoint in FARM_MODEL_PATH against the identity the run recorded (the check a
    worker makes before it sends anything), so a swapped or truncated checkpoint shows here."""
    try:
        recorded = manifests.recorded_weights(manifests.read(settings.output_dir))
    except FileNotFoundError:
        return ok(f"weights: no run in {settings.output_dir} yet; the first worker records "
                  "the checkpoint's identity")
    except ConfigError as e:
        return fail(f"weights: {e}")
    if not isinstance(recorded, dict):
        return warn("weights: the run records no weights identity (started by an older "
                    "hsfarm); only the canary guards the served model")
    if not settings.model_path:
        return warn("weights: FARM_MODEL_PATH is not set, so the checkpoint cannot be checked "
                    f"here against the run's identity {recorded.get('id')}")
    try:
        current = weights.weights_identity(Path(settings.model_path))
    except (ConfigError, OSError) as e:
        return fail(f"weights: {e}")
    unknown = weights.incomparable(recorded, current)
    if unknown:
        return warn(f"weights: cannot be compared here ({unknown}); the canary guards the "
                    "served model")
    why = weights.mismatch(recorded, current, Path(settings.model_path))
    if why:
        return fail(f"weights: {why}")
    if weights.older_scheme(recorded):
        return warn(f"weights: {settings.model_path} matches the run's identity "
                    f"{recorded.get('id')}, but {weights.V1_BLIND}")
    return ok(f"weights: {settings.model_path} is the run's checkpoint (identity "
              f"{recorded.get('id')}, {len(current['shards'])} shards)")


def check_served_weights(settings: Settings) -> Line:
    """The weights the server says it serves (its live ready marker) against the run's and
    FARM_MODEL_PATH's: the check a worker makes at start-up, before it takes anything."""
    found = [m for m in mk.markers(settings.dump_dir) if m.state != mk.DEAD]
    if not found:
        return warn(f"served weights: no live ready marker in {settings.dump_dir}: start the "
                    "server, then preflight again")
    served = found[-1].info.get("weights")
    if not isinstance(served, dict):
        return warn("served weights: the server's hook does not say which weights it serves "
                    "(an older hsfarm in the server's python); only the canary guards them")
    summary = {"scheme": served.get("scheme"), "id": served.get("id"),
               "shards": len(served.get("shards") or []), "model_path":
               found[-1].info.get("model_path")}
    try:
        local = (weights.weights_identity(Path(settings.model_path)) if settings.model_path
                 else None)
        recorded = manifests.recorded_weights(manifests.read(settings.output_dir))
    except FileNotFoundError:
        recorded = None
    except (ConfigError, OSError, ValueError, AttributeError) as e:
        return fail(f"served weights: {e}")
    why = weights.served_mismatch(
        summary, recorded if isinstance(recorded, dict) else None, local,
        server_url=settings.server_url, model_path=Path(settings.model_path or "?"),
        manifest=settings.output_dir / outdir.MANIFEST,
        started=canary.path_in(settings.output_dir).exists())
    if why:
        return fail(f"served weights: {why}")
    if not summary["shards"]:
        return warn(f"served weights: the server's identity has no shards "
                    f"({served.get('error') or 'no *.safetensors files'}); only the canary "
                    "guards them")
    return ok(f"served weights: {summary['id']} ({summary['shards']} shards, from "
              f"{summary['model_path']}), the run's and FARM_MODEL_PATH's where they are known")


def check_collectives(settings: Settings, env: Mapping[str, str]) -> Line:
    """The NCCL settings given, and what NCCL chose for the running server (the INFO logs a
    launcher keeps: ``engine_dump/nccl.py``); a WARN with the fix on the slow ring."""
    given = nccl.tuning(dict(env))
    said = " ".join(f"{k}={v}" for k, v in given.items()) or "no NCCL_* setting given"
    port = urlsplit(settings.server_url).port or 30000
    logs = [d for d in nccl.log_dirs(port, dict(env)) if d.is_dir() and any(d.iterdir())]
    if not logs:
        return ok(f"collectives: {said}; no NCCL log of a server on port {port} (a server on "
                  "one GPU has none; the launchers keep one in "
                  f"{nccl.log_dirs(port, dict(env))[0]})")
    level, text = nccl.verdict(nccl.read_dir(logs[0]))
    return Line(level, f"collectives: {said}; {text} (from {logs[0]})")


def run_checks(settings: Settings, env: Mapping[str, str]) -> list[Line]:
    lines: list[Line] = []
    env_loaded = any(k == "REDIS_URL" or k.startswith("FARM_") for k in env)
    if not env_loaded:
        lines.append(warn(f"environment: no REDIS_URL or FARM_* variable set, checking the "
                          f"defaults; {LOAD_ENV}"))
    redis_line, r = check_redis(settings, env_loaded)
    server_line, engine = check_server(settings)
    lines += [redis_line, server_line]
    run, why = find_run(settings, engine is not None)
    if run is not None and r is not None:
        try:
            run = with_counts(run, r, settings)
        except Transient as e:
            why, run = f"the run index cannot be read ({e})", None
    lines.append(check_run(run, why))
    lines.append(check_weights(settings))
    lines.append(check_served_weights(settings))
    lines.append(check_output_disk(settings, run))
    lines += check_dump_dir(settings, run)
    lines.append(check_hook(settings, engine))
    lines.append(check_gpus())
    lines.append(check_collectives(settings, env))
    lines += check_plugin(env.get("SGLANG_PYTHON") or None)
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="ops/preflight.sh", description=__doc__.split("\n\n")[1])
    p.parse_args(argv)
    env = os.environ
    try:
        settings = Settings.from_env(env)
    except FarmError as e:
        print(fail(f"settings: {e}"))
        return 1
    lines = run_checks(settings, env)
    for line in lines:
        print(line, flush=True)
    return 1 if any(line.level == "FAIL" for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
