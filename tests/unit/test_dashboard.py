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
import itertools
import json
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


def test_sampled_series_are_thinned_evenly_keeping_the_newest() -> None:
    from producer.dashboard.data import thinned

    points = [{"t": i} for i in range(8640)]
    shown = thinned(points, 1000)
    assert len(shown) <= 1000 and shown[-1] == {"t": 8639}
    steps = {b["t"] - a["t"] for a, b in itertools.pairwise(shown)}
    assert steps == {9} and thinned(points[:10], 1000) == points[:10]
