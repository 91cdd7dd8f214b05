"""The dashboard, Flower and ``status`` against one real farm run with broken samples.

One run is shared by every test here (module fixture): a private Redis, the reference server
with three samples broken by its NaN fault and one sample too long for the run (rejected),
two real ``celery worker`` processes, a real Flower
and the dashboard (``python -m producer dashboard``), all on loopback. The page is rendered
by headless Debian Chromium; its numbers and ``/metrics`` are checked against the run index.
Set HSFARM_SCREENSHOT_DIR to keep the screenshots (``docs/img`` holds those of docs/monitoring.md).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from producer.localfarm.farm import LocalFarm, free_port, wait_until
from tests.conftest import CACHE, FAST_ENV, wait_finished, write_samples
from tests.support.chromium import chromium
from worker.state import keys

N_SAMPLES = 24
FAILED = ["ex-0020", "ex-0021", "ex-0022"]  # the NaN fault's key prefix ex-002 matches these
REJECTED = ["ex-0023"]  # 4,921 tokens, over FARM_MAX_TOKENS (rejected before the server)
NOT_DONE = FAILED + REJECTED
DONE = N_SAMPLES - len(NOT_DONE)
AUTH = ("watcher", "s3cret-pw")
# Slow retries (2 s, then 4 s) so a sample is visibly "retrying" for a while, and 3 attempts
ENV = dict(FAST_ENV, FARM_MAX_ATTEMPTS="3", FARM_RETRY_BACKOFF_S="2",
           FARM_RETRY_BACKOFF_MAX_S="4", FARM_MAX_TOKENS="4700")


@dataclass
class Run:
    farm: LocalFarm
    flower_port: int
    dashboard_port: int
    during: list[str] = field(default_factory=list)  # `status` printed while it ran
    tmp: Path = Path()

    def get(self, port: int, path: str, auth: tuple[str, str] | None = AUTH) -> tuple[int, str]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        if auth:
            token = base64.b64encode(":".join(auth).encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def index(self, name: str) -> dict[str, Any]:
        """One of the run's index entries, as the workers wrote it."""
        r = self.farm.redis()
        [run] = [str(k, "utf-8").rsplit(":", 1)[0] for k in r.scan_iter(f"{keys.PREFIX}:*:meta")]
        if name == keys.DONE:
            pairs: list[tuple[bytes, float]] = r.zrange(  # type: ignore[assignment]
                f"{run}:{name}", 0, -1, withscores=True)
            return {str(k, "utf-8"): s for k, s in pairs}
        raw: dict[bytes, bytes] = r.hgetall(f"{run}:{name}")  # type: ignore[assignment]
        return {str(k, "utf-8"): json.loads(v) for k, v in raw.items()}


def _collect_status_until_done(run: Run) -> None:
    def done() -> bool:
        run.during.append(run.farm.cli("status").stdout)
        return "finished:" in run.during[-1]

    wait_until(done, 240, "the run to finish (as status says)", poll_s=0.5)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("dashboard")
    farm = LocalFarm(tmp / "farm", cache_dir=CACHE, chunked_prefill_size=256,
                     extra_env=dict(ENV))
    try:
        farm.start_redis()
        farm.start_server(["--inject-fault", "nan:ex-002", "--forward-delay-s", "0.05"])
        flower_port, dashboard_port = free_port(), free_port()
        farm.start_flower(flower_port, ":".join(AUTH))  # before any task: it sees every event
        farm.start_worker("w1", concurrency=2)
        farm.start_worker("w2", concurrency=2)
        data = tmp / "data.json"
        write_samples(data, N_SAMPLES)
        res = farm.cli("enqueue", str(data), "--no-progress")
        assert f"published: {N_SAMPLES}" in res.stdout, res.stdout + res.stderr
        farm.start_dashboard(dashboard_port, "--basic-auth", ":".join(AUTH), "--sample-s", "1")
        r = Run(farm, flower_port, dashboard_port, tmp=tmp)
        _collect_status_until_done(r)
        (tmp / "status-during.txt").write_text("\n".join(r.during))  # for a person to read
        wait_finished(farm, N_SAMPLES)
        time.sleep(2.5)  # the dashboard's next samples see the finished run
        yield r
    finally:
        farm.close(kill=True)


def test_status_shows_retrying_samples_as_they_fail_and_says_finished(run: Run) -> None:
    # While the run went on, status named each broken sample with its last error
    retrying = [out for out in run.during if "retrying: " in out]
    assert retrying, "status never showed a retrying sample:\n" + "\n".join(run.during)
    for key in FAILED:
        assert any(re.search(rf"  {key} after attempt \d: Corrupt: .*NaN/Inf", out)
                   for out in retrying), key
    assert any("unacked " in out and "ETA " in out and "elapsed " in out for out in run.during)
    # And at the end it says so, with the counts, and the ETA is gone
    final = run.farm.cli("status").stdout
    assert f"finished: every sample has an outcome ({DONE} done, 3 failed, 1 rejected)" \
        in final, final
    assert "ETA -" in final and "retrying: " not in final
    # And --json --failures is one JSON document, failures inside it
    res = run.farm.cli("status", "--json", "--failures")
    body = json.loads(res.stdout)
    assert sorted(f["key"] for f in body["failures"]) == NOT_DONE
    assert body["finished"] and (body["done"], body["failed"], body["rejected"]) == (DONE, 3, 1)
    assert body["bytes_per_s"] > 0 and body["elapsed_s"] > 0


def test_flower_counts_failed_samples_as_failed(run: Run) -> None:
    status, body = run.get(run.flower_port, "/api/tasks")
    assert status == 200, body
    tasks = json.loads(body)
    by_state: dict[str, set[str]] = {}
    for t in tasks.values():
        by_state.setdefault(t["state"], set()).add(t["args"])
    assert by_state.get("FAILURE") == set(NOT_DONE), by_state  # failed and rejected alike
    assert len(by_state.get("SUCCESS", ())) == DONE
    # And Flower's own Prometheus metrics count them as failed, not succeeded
    status, metrics = run.get(run.flower_port, "/metrics")
    counts: dict[str, float] = {}
    for m in re.finditer(r'^flower_events_total\{[^}]*type="(task-\w+)"[^}]*\} (\S+)$', metrics,
                         re.M):
        counts[m[1]] = counts.get(m[1], 0) + float(m[2])
    assert counts["task-failed"] == len(NOT_DONE) and counts["task-succeeded"] == DONE, counts


def test_dashboard_requires_the_password(run: Run) -> None:
    for path in ("/", "/api/run", "/metrics", "/static/dashboard.js"):
        assert run.get(run.dashboard_port, path, auth=None)[0] == 401
        assert run.get(run.dashboard_port, path, auth=(AUTH[0], "wrong"))[0] == 401
    assert run.get(run.dashboard_port, "/static/../dashboard.py")[0] == 404


def test_dashboard_metrics_match_the_index(run: Run) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = run.get(run.dashboard_port, "/metrics")
    assert status == 200
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in text_string_to_metric_families(text) for s in fam.samples}

    def value(name: str, **labels: str) -> float:
        [v] = [v for (n, ls), v in values.items()
               if n == name and set(labels.items()) <= set(ls)]
        return v

    done, failed = run.index(keys.DONE), run.index(keys.FAILED)
    assert value("hsfarm_samples", state="done") == len(done) == DONE
    assert value("hsfarm_samples", state="failed") == len(failed) == len(FAILED)
    assert value("hsfarm_samples", state="rejected") == len(run.index(keys.REJECTED)) == 1
    assert value("hsfarm_samples", state="total") == N_SAMPLES
    assert value("hsfarm_finished") == 1 and value("hsfarm_server_up") == 1
    assert value("hsfarm_broker_messages", state="unacked") == 0
    assert value("hsfarm_workers") == 2
    assert value("hsfarm_disk_free_bytes", disk="output") > 0
    reasons = {dict(ls)["kind"]: dict(ls)["reason"]
               for (n, ls), _ in values.items() if n == "hsfarm_failures"}
    assert "NaN/Inf" in reasons["failed"] and "over the maximum of N" in reasons["rejected"]
    assert value("hsfarm_failures", kind="failed") == len(FAILED)
    assert value("hsfarm_failures", kind="rejected") == len(REJECTED)


def test_dashboard_history_comes_from_the_index(run: Run) -> None:
    status, body = run.get(run.dashboard_port, "/api/run")
    assert status == 200, body
    snap = json.loads(body)
    h, done = snap["history"], run.index(keys.DONE)
    # The progress series starts at the run's first enqueue with nothing done, ends at its
    # last outcome with the index's counts, and never goes down
    assert h["done"][0] == 0 and h["done"][-1] == len(done) == DONE
    assert (h["failed"][-1], h["rejected"][-1]) == (len(FAILED), len(REJECTED))
    assert all(a <= b for a, b in itertools.pairwise(h["done"]))
    assert abs(h["t"][-1] - max([*done.values(), *(
        f["at"] for f in run.index(keys.FAILED).values())])) < 1.0
    assert max(h["samples_per_s"]) > 0 and max(h["bytes_per_s"]) > 0


def test_dashboard_page_renders_in_chromium(run: Run) -> None:
    url = f"http://{AUTH[0]}:{AUTH[1]}@127.0.0.1:{run.dashboard_port}/"
    res = chromium(url, run.tmp, "--dump-dom")
    dom = res.stdout
    assert 'data-ready="1"' in dom, res.stderr[-2000:] + dom[-3000:]

    def shown(name: str) -> str:
        m = re.search(rf'id="v-{name}">([^<]*)<', dom)
        assert m, name
        return m[1]

    # Then its figures are the index's
    assert (int(shown("done")), int(shown("total"))) == (len(run.index(keys.DONE)), N_SAMPLES)
    assert int(shown("failed")) == len(run.index(keys.FAILED)) == len(FAILED)
    assert int(shown("rejected")) == len(REJECTED)
    assert shown("server") == "up" and shown("workers") == "2"
    assert re.search(r'class="badge finished"', dom)
    # And every plot was drawn by uPlot, the index-based ones over the whole run
    plots = dict(re.findall(r'id="plot-(\w+)" data-points="(\d+)"', dom))
    assert set(plots) == {"progress", "throughput", "eta", "disks", "broker", "server"}
    assert int(plots["progress"]) == 300 and all(int(n) >= 2 for n in plots.values())
    assert dom.count("<canvas") == 6
    # And the failures table names the reason and how many
    assert re.search(rf"<td>failed</td><td>{len(FAILED)}</td><td[^>]*>Corrupt: [^<]*NaN/Inf", dom)
    assert re.search(r"<td>rejected</td><td>1</td><td[^>]*>sample has N tokens", dom)
    shots = Path(os.environ.get("HSFARM_SCREENSHOT_DIR", run.tmp))
    shots.mkdir(parents=True, exist_ok=True)
    res = chromium(url, run.tmp, "--window-size=1280,1400",
                   f"--screenshot={shots / 'dashboard.png'}")
    assert (shots / "dashboard.png").stat().st_size > 20_000, res.stderr[-2000:]
    flower = f"http://{AUTH[0]}:{AUTH[1]}@127.0.0.1:{run.flower_port}/tasks"
    chromium(flower, run.tmp, "--window-size=1280,900", f"--screenshot={shots / 'flower.png'}")
    assert (shots / "flower.png").stat().st_size > 20_000


def test_server_down_then_requeued_samples_show_their_new_attempt(run: Run,
                                                                  tiny_model: Path) -> None:
    farm = run.farm
    # Given the server stopped
    farm.procs["server"].kill_group()
    # Then status still works, without FARM_MODEL_PATH (the manifest names the run)
    res = farm.cli("status")
    assert res.returncode == 0 and "manifest.json" in res.stdout, res.stdout + res.stderr
    # And the dashboard says the server is down
    wait_until(lambda: json.loads(run.get(run.dashboard_port, "/api/run")[1])["server"]["up"]
               is False, 15, "the dashboard to see the server down")
    # When the failed samples are enqueued again while it is down
    res = farm.cli("enqueue", "--retry-failed", "--no-progress",
                   str(run.tmp / "data.json"), env={"FARM_MODEL_PATH": str(tiny_model)})
    assert f"published: {len(FAILED)}" in res.stdout, res.stdout + res.stderr
    # Then status says the workers are paused and why, and gives no ETA while they wait
    said: list[str] = []

    def paused() -> bool:
        said.append(farm.cli("status").stdout)
        return "does not answer" in said[-1] and "running 0," in said[-1]

    wait_until(paused, 60, "status to show the pause", poll_s=0.5)
    (run.tmp / "status-paused.txt").write_text(said[-1])
    assert re.search(r"paused +\d+ process(es)?: server http://\S+ does not answer", said[-1])
    assert "ETA - (paused, see below)" in said[-1], said[-1]
    # When the server is back, without the fault
    farm.start_server(["--forward-delay-s", "0.05"])
    wait_until(lambda: len(run.index(keys.DONE)) == N_SAMPLES - 1, 120, "the requeued samples")
    # Then Flower shows each requeued sample's new task (its own id) as a success, and the
    # old task's failure is kept as it was (the index records a sample done just before its
    # task returns, so Flower's task-succeeded event may come a moment later)
    def flower_tasks() -> list[dict[str, Any]]:
        return list(json.loads(run.get(run.flower_port, "/api/tasks")[1]).values())

    def states(key: str) -> list[str]:
        mine = sorted((t for t in flower_tasks() if t["args"] == key), key=lambda t: t["received"])
        return [t["state"] for t in mine]

    with contextlib.suppress(TimeoutError):
        wait_until(lambda: all(states(k)[-1:] == ["SUCCESS"] for k in FAILED), 30,
                   "Flower to see the requeued tasks succeed", poll_s=0.5)
    tasks = flower_tasks()
    for key in FAILED:
        mine = sorted((t for t in tasks if t["args"] == key), key=lambda t: t["received"])
        assert [t["state"] for t in mine] == ["FAILURE", "SUCCESS"], (key, mine)
        assert mine[0]["uuid"] != mine[1]["uuid"]
    assert [t["state"] for t in tasks if t["args"] == REJECTED[0]] == ["FAILURE"]
    out = farm.cli("status").stdout
    assert "finished: every sample has an outcome (23 done, 0 failed, 1 rejected)" in out, out
    shots = Path(os.environ.get("HSFARM_SCREENSHOT_DIR", run.tmp))
    flower = f"http://{AUTH[0]}:{AUTH[1]}@127.0.0.1:{run.flower_port}/tasks"
    chromium(flower, run.tmp, "--window-size=1280,560",
             f"--screenshot={shots / 'flower-requeued.png'}")


def test_dashboard_refuses_to_start_without_a_password(tmp_path: Path) -> None:
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE)  # nothing started: it must not get far
    for args, says in ((["dashboard"], "the dashboard needs a password"),
                       (["dashboard", "--no-auth", "--address", "0.0.0.0"],
                        "--no-auth is refused on 0.0.0.0"),
                       (["dashboard", "--basic-auth", "nopassword"], "USER:PASSWORD")):
        res = farm.cli(*args, timeout_s=60)
        assert res.returncode == 2 and says in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
