"""The stall rule from its signals alone (producer/stall.py): no worker, a quiet spell past the
slowest sample's time limit and what the workers wait on; a slow sample under its limit, new
work after a quiet spell and parked samples are no stall. Its gauge in /metrics, parsed by
prometheus_client. No Redis, no farm (tests/farm/test_stall.py has the real ones)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine_dump.dumpfile import DTYPE_BF16, bytes_per_token
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from producer.stall import (
    DUMP_DIR,
    NO_PROGRESS,
    NO_WORKER,
    PAUSED,
    SERVER_DOWN,
    Signals,
    judge,
    pause_kind,
    run_state,
    stall_after_s,
)
from worker.core.dumps import dump_dir_gone
from worker.core.settings import Settings

NOW = 1_000_000.0
AFTER_S = 960.0


def _host(alive: bool = True, server: str = "ok", age_s: float = 3.0) -> dict[str, Any]:
    return {"host": "gpu1", "alive": alive, "server": server, "heartbeat_age_s": age_s}


def _signals(**changes: Any) -> Signals:
    """A run with work waiting, one live host, last moved a minute ago."""
    base = Signals(work_waits=True, hosts=[_host()], paused={}, last_moved_at=NOW - 60,
                   now=NOW, stall_after_s=AFTER_S, heartbeat_ttl_s=20.0)
    return dataclasses.replace(base, **changes)


def _paused(reason: str) -> dict[str, dict[str, Any]]:
    return {"gpu1:123:1:m": {"reason": reason, "at": NOW - 1}}


def test_no_live_host_and_no_pause_is_a_stall_at_once() -> None:
    # Given samples waiting and the only host's heartbeat 45 s old (its workers SIGKILLed)
    stall = judge(_signals(hosts=[_host(alive=False, age_s=45.0)], last_moved_at=NOW - 50))
    # Then it is stalled with no worker, saying when a worker was last heard, and the fix
    assert stall is not None and stall.kind == NO_WORKER
    assert "the last heartbeat was 45s ago" in stall.reason
    assert stall.fix.startswith("start the workers")
    # And a run no worker ever started says so
    never = judge(_signals(hosts=[]))
    assert never is not None and "no worker has started for this run" in never.reason
    # But a worker paused at its start (its host not beating yet) is not "no worker"
    assert judge(_signals(hosts=[], paused=_paused("canary mismatch: ..."))) is None


def test_a_slow_sample_under_its_time_limit_is_no_stall() -> None:
    # Given a live worker whose one running sample has taken 15 of its 16 minutes
    signals = _signals(last_moved_at=NOW - (AFTER_S - 60), running=1)
    # Then the run is running, not stalled
    assert judge(signals) is None
    # But past the slowest sample's time limit with nothing finished, it is
    stall = judge(dataclasses.replace(signals, last_moved_at=NOW - AFTER_S - 1, retrying=1,
                                      retry_reasons=["Transient: timed out"]))
    assert stall is not None and stall.kind == NO_PROGRESS
    assert stall.reason == ("no sample finished in 16 min, longer than the slowest sample's "
                            "time limit (16 min) (running 1, retrying 1; last error: Transient: "
                            "timed out)")


def test_a_quiet_run_names_what_its_workers_wait_on() -> None:
    quiet = NOW - AFTER_S - 5
    server = _paused("server http://10.0.0.1:30000 does not answer (restarting, loading the "
                     "model, or hung)")
    canary = _paused("the canary could not be checked: ServerUnavailable: GET http://x/model_info")
    cases = [(server, [_host()], SERVER_DOWN), (canary, [_host()], SERVER_DOWN),
             ({}, [_host(server="down (URLError)")], SERVER_DOWN),
             (_paused(dump_dir_gone(Path("/dev/shm/d"))), [_host()], DUMP_DIR),
             (_paused("dump dir /dev/shm/d low: 1.0 MB free, waiting for 268.4 MB"), [_host()],
              DUMP_DIR),
             (_paused("output disk /nvme/out low: 1.0 MB free"), [_host()], PAUSED)]
    for paused, hosts, kind in cases:
        stall = judge(_signals(paused=paused, hosts=hosts, last_moved_at=quiet))
        assert stall is not None and stall.kind == kind, (paused, stall)
    # And under the stall time the same pauses are a paused run, not a stalled one
    assert judge(_signals(paused=server)) is None
    assert run_state(False, None, True) == "paused"


def test_no_stall_without_waiting_work_or_since_new_work() -> None:
    # Given no live worker, but nothing a worker could take (finished, or only parked samples)
    assert judge(_signals(work_waits=False, hosts=[])) is None
    # And a quiet spell that new work (a publication, a worker's start) ended a minute ago
    assert judge(_signals(last_moved_at=NOW - 60)) is None
    assert run_state(True, {"kind": NO_WORKER}, False) == "finished"


def test_pause_reasons_of_the_workers_fall_in_their_kind() -> None:
    assert pause_kind(dump_dir_gone(Path("/dev/shm/x"))) == DUMP_DIR
    assert pause_kind("server http://h:1 does not answer (restarting, …)") == SERVER_DOWN
    assert pause_kind("canary mismatch: worst aux layer 4: max rel err 1.66") == PAUSED


def test_the_stall_time_is_the_longest_samples_time_limit_plus_the_backoff() -> None:
    settings = Settings.from_env({"FARM_TASK_TIME_LIMIT_S": "900",
                                  "FARM_RETRY_BACKOFF_MAX_S": "60",
                                  "FARM_MIN_SAMPLE_BYTES_PER_S": "50e6"})
    fp = Fingerprint("cfg", "tok", "tpl", (2, 30, 58), LAYER_CONVENTION, 7168, DTYPE_BF16,
                     8192, "reject")
    per_token = bytes_per_token(DTYPE_BF16, 7168)
    assert stall_after_s(settings, fp) == 900 + 8192 * per_token / 50e6 + 60


def test_the_stalled_gauge_names_its_reason() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from producer.dashboard.metrics_text import render

    def gauge(stall: dict[str, str] | None) -> list[tuple[dict[str, str], float]]:
        snap = {"run": "r1", "status": {"queued": 3, "unacked": 0, "finished": False,
                                        "bytes": 0, "tokens": 0, "rate_per_s": 0.0,
                                        "bytes_per_s": 0.0, "eta_s": None, "elapsed_s": 5.0,
                                        "paused": {}, "stall": stall},
                "sampled": {}, "disks": {"output": "/o", "dump": "/d"}, "failures": []}
        return [(s.labels, s.value) for f in text_string_to_metric_families(render(snap))
                for s in f.samples if s.name == "hsfarm_stalled"]

    assert gauge({"kind": NO_WORKER, "reason": "…", "fix": "…"}) == [
        ({"run": "r1", "reason": "no_worker"}, 1.0)]
    assert gauge(None) == [({"run": "r1", "reason": "none"}, 0.0)]
