"""A host cut off from Redis writes nothing once its lease may have run out.

Two hosts as Linux network namespaces, a third running redis-server, veth pairs between them
(10.214.0.0/16 addresses of these namespaces and loopback only). Each host runs one writer of
the same sample (``tests/support/lease_host.py``, driving ``worker.state.lease`` and
``worker.core.store`` as an attempt does) into one output dir both see, as hosts sharing an
output file system do. Host A takes the sample's lease, then its own firewall (nft in its
namespace, on its veth only) cuts it off from Redis; its lease runs out in Redis and host B
takes the sample and writes.
A, told to write while B's temp file is on the disk, must refuse: a write would remove B's
temp file (the store removes the temp files of writers that no longer hold the lease).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_dump.dumpfile import is_temp_name
from producer.localfarm.farm import wait_until
from tests.support import lease_host
from worker.core import tensorfile
from worker.core.finalfile import M_CONTENT
from worker.core.store import OutputStore

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None
                       or shutil.which("nft") is None,
                       reason="needs root, ip(8) and nft(8) for network namespaces"),
    pytest.mark.timeout(120),
]

TAG = f"{os.getpid() % 100000}"
PASSWORD = "lease-partition-pw"
PORT = 6391
TTL_S = 4.0
KEY = "s-partition"


def sh(*argv: str, check: bool = True, stdin: str | None = None) -> None:
    subprocess.run(argv, input=stdin, capture_output=True, text=True, check=check, timeout=60)


def _network(ns: dict[str, str]) -> None:
    """Hosts a and b, each with a veth pair into Redis's namespace."""
    for name in ns.values():
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
    for i, host in enumerate(("a", "b"), start=1):
        veth, peer = f"lp{TAG}{host}", f"lp{TAG}r{host}"
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", peer, "netns", ns["redis"])
        sh("ip", "link", "set", veth, "netns", ns[host])
        sh("ip", "-n", ns["redis"], "addr", "add", f"10.214.{i}.1/30", "dev", peer)
        sh("ip", "-n", ns["redis"], "link", "set", peer, "up")
        sh("ip", "-n", ns[host], "addr", "add", f"10.214.{i}.2/30", "dev", veth)
        sh("ip", "-n", ns[host], "link", "set", veth, "up")


def _partition(netns: str, veth: str) -> None:
    """The host's own firewall drops everything on its veth (Redis's only way in or out)."""
    rules = (f"table inet lp{TAG} {{\n"
             f"  chain i {{ type filter hook input priority 0; iifname \"{veth}\" drop; }}\n"
             f"  chain o {{ type filter hook output priority 0; oifname \"{veth}\" drop; }}\n"
             "}\n")
    sh("ip", "netns", "exec", netns, "nft", "-f", "-", stdin=rules)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[dict[str, str]]:
    ns = {"redis": f"lpr{TAG}", "a": f"lpa{TAG}", "b": f"lpb{TAG}"}
    redis_proc = None
    try:
        _network(ns)
        redis_proc = subprocess.Popen(
            ["ip", "netns", "exec", ns["redis"], shutil.which("redis-server") or "redis-server",
             "--port", str(PORT), "--bind", "10.214.1.1 10.214.2.1", "--requirepass",
             PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        yield ns
    finally:
        if redis_proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(redis_proc.pid, signal.SIGKILL)
            redis_proc.wait(10)
        for name in ns.values():
            sh("ip", "netns", "del", name, check=False)  # its veth ends go with it


def _writer(netns: str, host: str, subnet: int, out: Path, go: Path,
            write_delay_s: float) -> subprocess.Popen[str]:
    url = f"redis://:{PASSWORD}@10.214.{subnet}.1:{PORT}/0"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-m", "tests.support.lease_host", url,
         str(out), KEY, host, str(TTL_S), str(go), str(write_delay_s)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _temps(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if is_temp_name(p.name)]


def test_a_host_cut_off_from_redis_stops_writing_before_another_takes_its_sample(
        hosts: dict[str, str], tmp_path: Path) -> None:
    out, go_a, go_b = tmp_path / "out", tmp_path / "go-a", tmp_path / "go-b"
    OutputStore(out, lease_host.fingerprint()).open()
    go_b.touch()  # B writes as soon as it holds the lease
    # Given host A holds the sample's lease
    a = _writer(hosts["a"], "hostA", 1, out, go_a, 0.0)
    assert a.stdout is not None
    assert a.stdout.readline().strip() == "leased"
    # When A's firewall cuts it off from Redis, and its lease runs out there
    _partition(hosts["a"], f"lp{TAG}a")
    t_cut = time.monotonic()
    # Then host B takes the sample and writes its file (its temp file on the disk a while)
    b = _writer(hosts["b"], "hostB", 2, out, go_b, 6.0)
    wait_until(lambda: bool(_temps(out)), 30, "host B's temp file")
    b_temp = _temps(out)[0]
    took_over_s = time.monotonic() - t_cut
    # When A, still cut off, reaches its write
    go_a.touch()
    a_said = a.communicate(timeout=60)[0].strip().splitlines()[-1]
    b_temp_whole_after_a = b_temp.exists()
    b_said = b.communicate(timeout=60)[0].strip().splitlines()[-1]
    print(f"\nB took the sample {took_over_s:.1f}s after A was cut off; A: {a_said!r}; "
          f"B: {b_said!r}; B's temp file there after A's turn: {b_temp_whole_after_a}")
    # Then A wrote nothing and B's temp file was left alone
    assert a_said.startswith("LeaseLost: "), a_said
    assert "not renewed" in a_said and "writes nothing" in a_said
    assert b_temp_whole_after_a
    # And the sample's file is B's, whole
    assert b_said == "wrote", b_said
    store = OutputStore(out, lease_host.fingerprint()).open()
    v = store.verify(KEY, "hostB")
    assert tensorfile.header_metadata(v.path)[M_CONTENT] == "hostB"
    assert v.tokens == lease_host.N_TOKENS and not _temps(out)
