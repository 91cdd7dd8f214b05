"""Redis across hosts is not an open door: a password, TLS, and refusal of anything less.

The refusal tests run their commands in a network namespace of their own (``unshare --net``,
only a loopback that is down), so the non-loopback address they name is never reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from producer.localfarm.farm import free_port
from producer.preflight import check_redis
from tests.conftest import assert_farm_invariants, wait_finished
from tests.support.faults import enqueue, running_farm
from tests.support.redis_auth import OPEN_DOOR
from worker.core.errors import ConfigError
from worker.state import broker

# The default user stays on, with a password of its own: with it off, Redis 7.0 drops every
# MULTI/EXEC from its AOF on restart (broker.replay_loss)
ACL = ["--user", "default", "on", ">admin-pw", "~*", "&*", "+@all",
       "--user", "alice", "on", ">secret", "~*", "&*", "+@all"]


def _isolated(argv: list[str], timeout_s: float, **extra: str) -> tuple[int | None, str]:
    """Run ``argv`` in a network namespace of its own with the open-door URL; rc None: still
    running after ``timeout_s`` (killed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_") and k != "REDIS_URL"}
    env.update(REDIS_URL=OPEN_DOOR, FARM_MODEL_PATH="/nonexistent", FARM_DUMP_DIR="/tmp/x",
               PYTHONUNBUFFERED="1", **extra)
    try:
        res = subprocess.run(["unshare", "--net", *argv], env=env, capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return None, out.decode() if isinstance(out, bytes) else out
    return res.returncode, res.stdout + res.stderr


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare --net (root) to keep the refused address unreachable")
def test_open_door_url_is_refused_by_worker_enqueue_and_preflight(tmp_path: Path) -> None:
    # Given a REDIS_URL on another host, without a password
    data = tmp_path / "d.json"
    data.write_text("[]")
    fix = "FARM_ALLOW_UNAUTHENTICATED_REDIS"
    # When a worker starts: then it exits 2 before consuming, naming the URL and the fix
    rc, out = _isolated([sys.executable, "-m", "celery", "-A", "worker", "worker", "-c", "1",
                         "--without-gossip", "--without-mingle"], timeout_s=60)
    assert rc == 2 and fix in out and "redis://alice@192.0.2.1:6379/0" in out, (rc, out[-2000:])
    assert " ready." not in out
    # When enqueue or status runs: exit 2 with the same message
    for cmd in (["enqueue", str(data)], ["status"]):
        rc, out = _isolated([sys.executable, "-m", "producer", *cmd], timeout_s=60)
        assert rc == 2 and fix in out and "Traceback" not in out, (cmd, rc, out[-2000:])
    # When preflight runs: a FAIL line for Redis with the fix
    rc, out = _isolated([sys.executable, "-m", "producer.preflight"], timeout_s=120)
    assert rc == 1, out
    assert any(line.startswith("FAIL") and "redis" in line and fix in line
               for line in out.splitlines()), out
    # When the opt-out is set: then preflight goes on to connect (unreachable in here)
    rc, out = _isolated([sys.executable, "-m", "producer.preflight"], timeout_s=120,
                        FARM_ALLOW_UNAUTHENTICATED_REDIS="1")
    assert "FAIL  redis at redis://alice@192.0.2.1:6379/0: Error 101" in out, out


def _tls_files(d: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for 127.0.0.1 (server and client use)."""
    d.mkdir()
    ca_key, ca, key, csr, cert = (d / n for n in ("ca.key", "ca.crt", "r.key", "r.csr", "r.crt"))
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for argv in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "1", "-subj", "/CN=hsfarm-test-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "1", "-extfile", ext],
    ):
        subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True, timeout=60)
    return ca, cert, key


def _tls_available() -> str | None:
    if shutil.which("openssl") is None:
        return "no openssl CLI to make a test CA"
    res = subprocess.run(["redis-server", "--tls-port", "0", "--test-memory", "1"],
                         capture_output=True, text=True, timeout=30)
    if "TLS" in res.stdout + res.stderr and "not" in (res.stdout + res.stderr).lower():
        return f"redis-server built without TLS: {(res.stdout + res.stderr).strip()[:200]}"
    return None


def test_acl_user_then_tls_run_end_to_end(tmp_path: Path, tiny_model: Path) -> None:
    with running_farm(tmp_path, start_redis=False) as farm:
        # Given a Redis whose only user is alice (default user off)
        farm.redis_port = free_port()
        farm.redis_url = f"redis://alice:secret@127.0.0.1:{farm.redis_port}/0"
        farm.start_redis(extra_args=ACL)
        # When samples are enqueued and a worker runs over that URL
        keys = enqueue(farm, tmp_path, 3)
        farm.start_worker("w1", concurrency=1)
        wait_finished(farm, 3)
        # Then they are all done, and the password shows in no log nor command output
        assert_farm_invariants(farm, keys)
        shown = farm.cli("status").stdout + farm.cli("settings").stdout
        assert "secret" not in shown and "alice" in farm.cli("settings").stdout
        assert "secret" not in farm.procs["w1"].log.read_text()
        farm.procs["w1"].stop()
        # And with the default user off, workers and preflight refuse that Redis
        r = farm.redis()
        r.acl_setuser("default", enabled=False)
        with pytest.raises(ConfigError, match="default user off"):
            broker.check_persistence(r, farm.settings())
        line, _ = check_redis(farm.settings(), env_loaded=True)
        assert line.level == "FAIL" and "default user off" in str(line), line
        farm.procs.pop("redis").stop()
        shutil.rmtree(farm.work_dir / "redis")  # a new Redis: TLS alone carries what follows

        why = _tls_available()
        if why:
            pytest.skip(why)
        # Given a Redis that speaks only TLS (mutual: it checks the client's certificate)
        ca, cert, key = _tls_files(tmp_path / "tls")
        farm.redis_port = free_port()
        farm.redis_url = f"rediss://alice:secret@127.0.0.1:{farm.redis_port}/0"
        farm.extra_env.update(FARM_REDIS_CA_FILE=str(ca), FARM_REDIS_CERT_FILE=str(cert),
                              FARM_REDIS_KEY_FILE=str(key))
        farm.start_redis(extra_args=[*ACL, "--port", "0", "--tls-port", str(farm.redis_port),
                                     "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                                     "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "yes"])
        # When more samples are enqueued and a worker runs over rediss://
        more = enqueue(farm, tmp_path, 3, start=3)
        farm.start_worker("w2", concurrency=1)
        wait_finished(farm, 3)
        # Then they are done too, and the password shows in no log
        res = farm.cli("audit", "--data", str(tmp_path / "data-3.json"))
        assert res.returncode == 0 and "whole: 3 " in res.stdout, res.stdout + res.stderr
        assert all(any((farm.output_dir / "samples").rglob(f"{k}*")) for k in more)
        assert "secret" not in farm.procs["w2"].log.read_text()
