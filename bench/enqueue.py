"""Enqueue and status at the run's real size: 37,312 samples, half of them already done.

    python bench/enqueue.py [--samples 37312] [--done 18421] [--big-gb 1.0] [--json out]

Against a private Redis (AOF), each step in a fresh process: a plain ``send_task`` loop as the
baseline; ``enqueue`` on an empty run; again with ``--done`` final files done (and after
FLUSHALL, when headers rebuild the index), with bytes of outputs read; ``status`` on the done
run; a ``--big-gb`` JSONL's peak RSS. Results: docs/benchmarks.md, "Enqueue and status".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from producer.localfarm.farm import LocalFarm

ROOT = Path(__file__).resolve().parent.parent

# Runs a module as ``python -m`` would, then prints its peak RSS and I/O counters.
MEASURED = ("import atexit, resource, runpy, sys, time; t0 = time.perf_counter()\n"
            "def _report():\n"
            "    io = dict(l.split(': ') for l in open('/proc/self/io').read().split('\\n') if l)\n"
            "    print('MEASURED', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
            "io['rchar'], time.perf_counter() - t0, file=sys.stderr)\n"
            "atexit.register(_report)\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")

PLAIN_LOOP = """
import sys, time
from worker.app import app
from worker.core.datafile import Span, scan
from worker.core.run import TASK_NAME
from worker.core.samples import content_hash
path, queue = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
n = 0
for item in scan(__import__("pathlib").Path(path)):
    if isinstance(item, Span):
        ref = {"k": f"plain-{item.index}", "f": path, "o": item.offset, "n": len(item.raw),
               "h": content_hash(item.raw), "i": item.index}
        app.send_task(TASK_NAME, args=[ref], task_id=f"plain-{item.index}", queue=queue)
        n += 1
print("PLAIN", n, time.perf_counter() - t0)
"""


def write_jsonl(path: Path, n: int, chars: int = 2000, prefix: str = "s") -> None:
    """``n`` conversations of about ``chars`` characters each, with ids."""
    filler = ("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[:chars]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{prefix}-{i:07d}", "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"{i} {filler}"}]}) + "\n")


def measured(farm: LocalFarm, module_args: list[str]) -> tuple[int, int, float, str]:
    """(peak RSS KB, bytes read, seconds, stdout) of ``python -m MODULE ARGS``."""
    res = subprocess.run([sys.executable, "-c", MEASURED, *module_args], env=farm.env(),
                         capture_output=True, text=True, timeout=3600, cwd=ROOT)
    line = next(x for x in res.stderr.splitlines() if x.startswith("MEASURED"))
    _, rss, rchar, secs = line.split()
    if res.returncode not in (0, 1):
        raise RuntimeError(res.stdout + res.stderr)
    return int(rss), int(rchar), float(secs), res.stdout


def used_memory(farm: LocalFarm) -> int:
    return int(farm.redis().info("memory")["used_memory"])


def plain_loop(farm: LocalFarm, data: Path) -> float:
    res = subprocess.run([sys.executable, "-c", PLAIN_LOOP, str(data), "bench-plain"],
                         env=farm.env(), capture_output=True, text=True, timeout=3600, cwd=ROOT)
    secs = next(x for x in res.stdout.splitlines() if x.startswith("PLAIN")).split()[2]
    farm.redis().delete("bench-plain")
    return float(secs)


def decided_s(stdout: str) -> float:
    return float(stdout.split("decided in ", 1)[1].split("s", 1)[0])


def fake_outputs(farm: LocalFarm, data: Path, n_done: int, tokens: int = 64,
                 mark_done: bool = False) -> None:
    """Real final files (``tokens`` tokens each: ~32 KB of tensor data after a header of
    under 1 KB) for the first ``n_done`` records of ``data``; ``mark_done``: and in the
    index, as the workers would have."""
    import numpy as np

    from worker.core.finalbytes import Part
    from worker.core.finalfile import M_CONTENT, M_SOURCE_FILE
    from worker.core.samples import sample_refs
    from worker.core.settings import Settings
    from worker.core.store import OutputStore
    from worker.server.fingerprint import run_fingerprint

    settings = Settings.from_env(farm.env())
    _, fp = run_fingerprint(settings)
    store = OutputStore(settings.output_dir, fp).open()
    h = fp.hidden_size
    parts = {"input_ids": Part.from_array("I64", np.arange(tokens)),
             "loss_mask": Part.from_array("I64", np.ones(tokens, np.int64)),
             "hidden_state": Part.from_array("BF16", np.zeros((tokens, h), np.uint16)),
             "aux_hidden_state": Part.from_array("BF16", np.zeros((tokens, 3 * h), np.uint16))}
    done = {}
    for i, ref in enumerate(sample_refs(data, settings.max_record_bytes, [], [])):
        if i == n_done:
            break
        path = store.write(ref.key, parts, {M_CONTENT: ref.sha256, M_SOURCE_FILE: ref.file})
        done[ref.key] = (path.stat().st_size, tokens)
    if mark_done:
        from worker.state.index import RunIndex

        RunIndex(farm.redis(), farm.run_id()).mark_done_many(done)


def fake_size(farm: LocalFarm) -> int:
    return next((farm.output_dir / "samples").rglob("*.safetensors")).stat().st_size


def status_all_done(farm: LocalFarm, n: int) -> tuple[float, float, int]:
    """(seconds in-process, seconds as a CLI, Redis bytes per done sample) with all done."""
    from producer.status import read_status
    from worker.core.settings import Settings
    from worker.server.fingerprint import run_fingerprint
    from worker.state.index import RunIndex

    settings = Settings.from_env(farm.env())
    _, fp = run_fingerprint(settings)
    index = RunIndex(farm.redis(), farm.run_id())
    before = used_memory(farm)
    keys = list(index.all_registered())
    for i in range(0, len(keys), 1000):
        p = farm.redis().pipeline()
        for key in keys[i : i + 1000]:
            p.zadd(index.k("done"), {key: time.time()})
            p.hset(index.k("bytes"), key, 117_000_000)
            p.hset(index.k("tokens"), key, 2048)
            p.hset(index.k("attempts"), key, 1)
            p.hset(index.k("tries"), key, 1)
        p.execute()
    per_done = (used_memory(farm) - before) // max(len(keys), 1)
    t0 = time.perf_counter()
    st = read_status(settings, fp)
    in_process = time.perf_counter() - t0
    # status stats each done sample's file: those without one (marked done here, never
    # written) are counted gone, not done
    assert st.done + st.files_gone == len(keys) == n, (st, n)
    _, _, cli_s, _ = measured(farm, ["producer", "status", "--json"])
    return in_process, cli_s, per_done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=37312)
    p.add_argument("--done", type=int, default=18421)
    p.add_argument("--big-gb", type=float, default=1.0)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    from sglang_patch.tiny_model import ensure_tiny_model

    model = ensure_tiny_model(Path.home() / ".cache" / "hsfarm")
    work = Path(tempfile.mkdtemp(prefix="hsfarm-bench-enqueue-"))
    farm = LocalFarm(work / "farm", extra_env={"FARM_MODEL_PATH": str(model)})
    out: dict[str, Any] = {"machine": platform.node(), "date": str(date.today()),
                           "cpus": os.cpu_count(), "samples": a.samples}
    try:
        farm.start_redis()
        data = work / "data.jsonl"
        write_jsonl(data, a.samples)
        out["plain_loop_s"] = plain_loop(farm, data)
        base = used_memory(farm)
        rss, rchar_fresh, secs, stdout = measured(farm, ["producer", "enqueue", str(data),
                                                         "--no-progress"])
        assert f"published: {a.samples}" in stdout, stdout
        out.update(enqueue_s=secs, enqueue_rss_mb=rss / 1024,
                   redis_bytes_per_queued=(used_memory(farm) - base) // a.samples)
        out["speedup_vs_plain"] = out["plain_loop_s"] / secs
        farm.redis().delete(farm.queue())  # as if the workers had taken them all
        fake_outputs(farm, data, a.done, mark_done=True)
        out["output_file_bytes"] = fake_size(farm)
        for case in ("index_kept", "index_lost"):
            if case == "index_lost":
                farm.redis().flushall()
            _, rchar, secs, stdout = measured(farm, ["producer", "enqueue", str(data),
                                                     "--no-progress"])
            assert f"already done: {a.done}" in stdout, stdout
            out[case] = {"enqueue_s": secs, "decide_s": decided_s(stdout),
                         "outputs_bytes_read_per_done": (rchar - rchar_fresh) // max(a.done, 1)}
            farm.redis().delete(farm.queue())
        in_s, cli_s, per_done = status_all_done(farm, a.samples)
        out.update(status_in_process_s=in_s, status_cli_s=cli_s, redis_bytes_per_done=per_done)
        farm.redis().flushall()
        big = work / "big.jsonl"
        n_big = int(a.big_gb * 1e9 / 4000)
        write_jsonl(big, n_big, chars=3900, prefix="b")
        rss, _, secs, _ = measured(farm, ["producer", "enqueue", str(big), "--no-progress"])
        out.update(big_file_gb=big.stat().st_size / 1e9, big_records=n_big,
                   big_enqueue_rss_mb=rss / 1024, big_enqueue_s=secs)
    finally:
        farm.close()
        subprocess.run(["rm", "-rf", str(work)])
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
