"""A stalled run, shown as stalled everywhere: ``status``, ``status --check``, ``/metrics``, the
dashboard's JSON and its page in headless Chromium; and a running or paused one, not.

Real farms (tests/conftest.py): a private Redis, the reference server slowed by
``--forward-delay-s`` so the run is still going when the test looks, one real ``celery
worker``, the dashboard sampling every second. Workers are SIGKILLed with their process group;
the server is SIGKILLed the same way. With HSFARM_SCREENSHOT_DIR=docs/img the screenshots of
docs/monitoring.md are written there (running, paused, stalled; the finished one is
test_dashboard.py's). A slow sample under its time limit is running, not stalled.
"""

from __future__ import annotations

import base64
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from producer.localfarm.farm import LocalFarm, free_port, wait_until
from tests.conftest import FarmFactory, write_samples
from tests.support.chromium import chromium
from worker.state import keys

N_SAMPLES = 40
AUTH = ("watcher", "s3cret-pw")
# A dead worker shows in seconds (its heartbeat's TTL); the slowest sample's time limit is
# FAST_ENV's 20 s (+ its bytes, + the 3 s retry backoff): the stall time, and the rate window
ENV = {"FARM_HEARTBEAT_TTL_S": "4", "FARM_REAPER_INTERVAL_S": "1"}
SLOW = ["--forward-delay-s", "0.4"]  # a few samples a second: the run lasts a while

pytestmark = pytest.mark.timeout(420)


class Watch:
    """What a person sees of one farm's run: ``status``, its JSON, the dashboard, /metrics."""

    def __init__(self, farm: LocalFarm, tmp: Path) -> None:
        self.farm, self.tmp, self.port = farm, tmp, free_port()
        farm.start_dashboard(self.port, "--basic-auth", ":".join(AUTH), "--sample-s", "1")
        wait_until(self._sampled, 60, "the dashboard's first sample", poll_s=0.5)

    def _sampled(self) -> bool:
        try:
            self.get("/api/run")
        except urllib.error.HTTPError as e:  # 503 until its first sample
            return e.code != 503
        return True

    def status(self) -> str:
        res = self.farm.cli("status")
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    def status_json(self) -> dict[str, Any]:
        return dict(json.loads(self.farm.cli("status", "--json").stdout))

    def get(self, path: str) -> str:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}")
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(AUTH).encode())
                       .decode())
        with urllib.request.urlopen(req, timeout=20) as resp:
            return str(resp.read().decode())

    def api(self) -> dict[str, Any]:
        return dict(json.loads(self.get("/api/run")))

    def metric(self, name: str) -> dict[str, float]:
        """The samples of one metric: its labels other than ``run`` -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        return {",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "run"): s.value
                for fam in text_string_to_metric_families(self.get("/metrics"))
                for s in fam.samples if s.name == name}

    def page(self, shot: str | None = None) -> str:
        """The page's DOM once its script ran, and a screenshot of it named ``shot``."""
        url = f"http://{AUTH[0]}:{AUTH[1]}@127.0.0.1:{self.port}/"
        res = chromium(url, self.tmp, "--dump-dom")
        assert 'data-ready="1"' in res.stdout, res.stderr[-2000:] + res.stdout[-3000:]
        if shot is None:
            return res.stdout
        shots = Path(os.environ.get("HSFARM_SCREENSHOT_DIR", self.tmp))
        shots.mkdir(parents=True, exist_ok=True)
        chromium(url, self.tmp, "--window-size=1280,1400", f"--screenshot={shots / shot}")
        assert (shots / shot).stat().st_size > 20_000
        return res.stdout


def _done(farm: LocalFarm) -> int:
    return int(farm.redis().zcard(keys.run_key(farm.run_id(), keys.DONE)))


def _badge(dom: str) -> str:
    m = re.search(r'id="state" class="badge (\w+)"', dom)
    assert m, dom[-3000:]
    return m[1]


def _until(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    wait_until(check, timeout_s, what, poll_s=0.5)


def _running_farm(farm_factory: FarmFactory, tmp_path: Path) -> tuple[LocalFarm, Watch]:
    farm = farm_factory("farm", env=ENV, server_args=SLOW, workers=("w1",))
    data = tmp_path / "data.json"
    write_samples(data, N_SAMPLES)
    res = farm.cli("enqueue", str(data), "--no-progress")
    assert f"published: {N_SAMPLES}" in res.stdout, res.stdout + res.stderr
    watch = Watch(farm, tmp_path)
    _until("a few samples done", lambda: _done(farm) >= 3, 120)
    return farm, watch


def test_workers_killed_the_run_is_stalled_everywhere_and_its_rate_drops_to_zero(
        farm_factory: FarmFactory, tmp_path: Path) -> None:
    # Given a run going well: samples done, more queued, a worker alive
    farm, watch = _running_farm(farm_factory, tmp_path)
    # Then nothing calls it stalled: status, --check (1: not finished), the page
    out = watch.status()
    assert "STALLED" not in out and re.search(r"ETA \d", out), out
    assert watch.status_json()["rate_per_s"] > 0
    assert farm.cli("status", "--check").returncode == 1
    dom = watch.page("dashboard-running.png")
    assert _badge(dom) == "running" and 'id="stall" hidden' in dom
    assert _done(farm) < N_SAMPLES, "the run finished before the test looked: slow it down"
    # When the worker is SIGKILLed, with its pool, with samples still queued
    farm.procs["w1"].kill_group()
    # Then status says the run is stalled, why and what to do, and gives no ETA
    _until("status to say stalled", lambda: "STALLED" in watch.status(), 30)
    out = watch.status()
    assert re.search(r"STALLED   no worker of this run is alive \(the last heartbeat was \d+s "
                     r"ago; a worker is dead once its heartbeat is 4s old\)", out), out
    assert "fix       start the workers (systemctl start hsfarm-worker@{1..4})" in out
    assert "ETA - (STALLED, see below)" in out
    (tmp_path / "status-stalled.txt").write_text(out)  # for a person (docs/monitoring.md)
    # And status --check exits 3, saying so
    res = farm.cli("status", "--check")
    assert res.returncode == 3, res.stdout + res.stderr
    assert res.stderr.startswith("stalled: no worker of this run is alive"), res.stderr
    # And the dashboard's JSON, /metrics and page say it too
    _until("the dashboard to see the stall", lambda: watch.api()["status"]["state"] == "stalled",
           15)
    st = watch.api()["status"]
    assert st["stall"]["kind"] == "no_worker" and st["eta_s"] is None
    assert watch.metric("hsfarm_stalled") == {"reason=no_worker": 1.0}
    dom = watch.page("dashboard-stalled.png")
    assert _badge(dom) == "stalled"
    assert re.search(r'<div id="stall"><b>Stalled: no worker of this run is alive', dom), dom
    assert "Fix: start the workers" in dom
    assert re.search(r'id="v-eta">- \(stalled\)<', dom)
    # When nothing finishes for the rate's window (the stall time: 20 s + the backoff here;
    # while the run is younger than that, the window is its age)
    _until("the rate's window to reach the stall time",
           lambda: watch.status_json()["rate_window_s"] >= 20, 40)
    window_s = watch.status_json()["rate_window_s"]
    assert window_s < 30, window_s
    # Then the rate is 0, in status, in /metrics and on the page
    _until("the rate to drop to 0", lambda: watch.status_json()["rate_per_s"] == 0,
           window_s + 15)
    assert re.search(r"speed     0\.00 samples/s", watch.status())
    _until("/metrics' rate to drop to 0",
           lambda: watch.metric("hsfarm_rate_samples_per_second") == {"": 0.0}, 15)
    assert "hsfarm_eta_seconds" not in watch.get("/metrics")
    assert 'id="v-rate">0.00/s<' in watch.page()


def test_server_down_paused_first_then_stalled_with_the_server_as_reason(
        farm_factory: FarmFactory, tmp_path: Path) -> None:
    # Given a run going well
    farm, watch = _running_farm(farm_factory, tmp_path)
    # When its server is SIGKILLed
    farm.procs["server"].kill_group()
    # Then the worker pauses, and for a while the run is paused, not stalled
    _until("status to show the pause", lambda: "does not answer" in watch.status(), 60)
    out = watch.status()
    assert re.search(r"paused +\d+ process(es)?: server http://\S+ does not answer", out), out
    assert "STALLED" not in out and farm.cli("status", "--check").returncode == 1
    _until("the dashboard to see the pause", lambda: watch.api()["status"]["state"] == "paused",
           15)
    assert watch.metric("hsfarm_stalled") == {"reason=none": 0.0}
    assert _badge(watch.page("dashboard-paused.png")) == "paused"
    # When nothing finishes for longer than the slowest sample's time limit
    # Then it is stalled, the server named as the reason, with the fix
    _until("status to say stalled", lambda: "STALLED" in watch.status(), 60)
    out = watch.status()
    assert re.search(r"STALLED   no sample finished in \d+s, longer than the slowest sample's "
                     r"time limit \(\d+s\): the inference server does not answer \(\d "
                     r"process\(es\) paused: ", out), out
    assert "fix       restart the inference server" in out
    (tmp_path / "status-server-down.txt").write_text(out)
    assert farm.cli("status", "--check").returncode == 3
    _until("/metrics to say stalled on the server",
           lambda: watch.metric("hsfarm_stalled") == {"reason=server_down": 1.0}, 15)
    # When the server is back
    before = _done(farm)
    farm.start_server(SLOW)
    # Then the run moves again and is no longer stalled, anywhere
    _until("a sample done after the restart", lambda: _done(farm) > before, 120)
    body = watch.status_json()
    assert body["stall"] is None and body["state"] == "running", body
    assert farm.cli("status", "--check").returncode == 1
    _until("/metrics to say not stalled",
           lambda: watch.metric("hsfarm_stalled") == {"reason=none": 0.0}, 15)
    assert watch.api()["status"]["state"] == "running"


def test_dashboard_shows_redis_away_as_stalled(farm_factory: FarmFactory,
                                               tmp_path: Path) -> None:
    # Given a run going well, watched by the dashboard
    farm, watch = _running_farm(farm_factory, tmp_path)
    # When Redis is SIGKILLed
    farm.procs["redis"].kill_group()
    # Then the dashboard keeps its last figures and calls the run stalled on Redis, with the fix
    _until("the dashboard to see Redis gone",
           lambda: watch.api()["status"]["state"] == "stalled", 30)
    snap = watch.api()
    assert snap["status"]["stall"]["kind"] == "redis" and "did not answer" in snap["error"]
    assert "start Redis" in snap["status"]["stall"]["fix"]
    assert watch.metric("hsfarm_stalled") == {"reason=redis": 1.0}
    # And status cannot run without Redis, and says so (exit 2)
    res = farm.cli("status", "--check")
    assert res.returncode == 2 and "Redis" in res.stderr, res.stdout + res.stderr


def test_a_slow_sample_under_its_time_limit_is_running_not_stalled(
        farm_factory: FarmFactory, tmp_path: Path) -> None:
    # Given one sample of 4,921 tokens that takes ~30 s (20 chunks of 256 tokens, 1.5 s each)
    # under a 60 s time limit (soft 48 s), so the stall time is 63 s; nothing else to do
    env = {**ENV, "FARM_TASK_TIME_LIMIT_S": "60", "FARM_VISIBILITY_TIMEOUT_S": "100",
           "FARM_REQUEST_TIMEOUT_S": "55"}
    farm = farm_factory("farm", env=env, server_args=["--forward-delay-s", "1.5"],
                        workers=("w1",))
    data = tmp_path / "data.json"
    write_samples(data, 1, start=23)
    assert "published: 1" in farm.cli("enqueue", str(data), "--no-progress").stdout
    # When status is asked all along, until it is done
    seen: list[tuple[float, str]] = []

    def done() -> bool:
        body = dict(json.loads(farm.cli("status", "--json").stdout))
        seen.append((float(body["elapsed_s"] or 0), str(body["state"])))
        assert body["stall"] is None, body
        return bool(body["finished"])

    _until("the slow sample", done, 120)
    # Then it was running the whole time and never stalled, though nothing finished for
    # over 20 s
    assert {state for _, state in seen[:-1]} == {"running"}, seen
    assert seen[-2][0] > 20, seen
