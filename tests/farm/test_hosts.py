"""Several hosts, one run: two hosts as Linux network namespaces, each also in a pid namespace
of its own (so neither can judge the other from its /proc: only heartbeats and TTLs tell), a
third namespace running the run's redis-server (with a password: it is not on loopback), veth
pairs between them. Each host has its own loopback-only reference server, dump dir and output
dir, and real ``celery worker`` processes started with ``ip netns exec``. Traffic uses
10.213.0.0/16 addresses of these namespaces and loopback only; the test process reaches Redis
over a veth pair of its own into Redis's namespace.

A host is lost the way a machine is: SIGKILL to its pid namespace's init, which kills every
process of it (its server and its workers) at once. Default timing settings throughout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from engine_dump.dumpfile import DUMP_SUFFIX, is_temp_name
from producer.localfarm.farm import LocalFarm, wait_until
from tests.conftest import CACHE, write_samples
from tests.support.faults import dashboard_metrics, text
from worker.core import outdir
from worker.core.settings import Settings
from worker.state import hosts, keys

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None
                       or shutil.which("unshare") is None,
                       reason="needs root, ip(8) and unshare(1) for network/pid namespaces"),
    pytest.mark.timeout(420),
]

TAG = str(os.getpid())  # names of this run: a 7-digit pid still fits a veth name (15)
PASSWORD = "hosts-test-pw"
REDIS_PORT = 6390
N_SAMPLES = 16
# Short waits of the test's own making; the settings that decide recovery keep their defaults
# (heartbeat TTL, reaper interval, lease TTL, visibility timeout).
ENV = {"FARM_PAUSE_POLL_S": "0.5", "FARM_RETRY_BACKOFF_S": "0.5",
       "FARM_RETRY_BACKOFF_MAX_S": "3", "FARM_JANITOR_INTERVAL_S": "1",
       "FARM_DUMP_TIMEOUT_S": "15", "FARM_LOG_LEVEL": "INFO"}


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60)


@dataclass
class Host:
    """One host: a network namespace, its farm directories, and its processes."""

    name: str
    netns: str
    redis_addr: str
    farm: LocalFarm
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def env(self) -> dict[str, str]:
        env = self.farm._farm_env()
        env.update(REDIS_URL=f"redis://:{PASSWORD}@{self.redis_addr}:{REDIS_PORT}/0",
                   FARM_HOST_ID=self.name)
        return env

    @property
    def worker_log(self) -> Path:
        return self.farm.work_dir / "logs" / f"worker{self.starts}.log"

    def start(self) -> None:
        """Its server and one worker (2 processes), as one pid namespace in its netns."""
        self.starts += 1
        logs = self.farm.work_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        server = [sys.executable, "-m", "sglang_patch.reference_server", "--port",
                  str(self.farm.server_port), "--dump-dir", str(self.farm.dump_dir),
                  "--model", "tiny", "--cache-dir", str(CACHE), "--chunked-prefill-size",
                  "256", "--threads", "1", "--forward-delay-s", "0.4"]
        worker = [sys.executable, "-m", "celery", "-A", "worker", "worker", "-n",
                  f"{self.name}@%h", "-c", "2", "--loglevel", "INFO", "-P", "prefork",
                  "--without-gossip", "--without-mingle"]
        # the server has torch (the workers run without it, as on a worker host)
        server_path = self.farm.env().get("PYTHONPATH", "")
        script = (f"PYTHONPATH='{server_path}' {_q(server)} >>{logs}/server.log 2>&1 & "
                  f"{_q(worker)} >>{self.worker_log} 2>&1 & wait")
        self.popen = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--mount-proc",
             "bash", "-c", script], env=self.env(), start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._ready, 180, f"{self.name}'s worker")

    def _ready(self) -> bool:
        assert self.popen is not None
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited; see {self.farm.work_dir / 'logs'}")
        return b" ready." in _read(self.worker_log)

    def kill(self) -> None:
        """SIGKILL the host's pid namespace init: every process of the host dies at once."""
        assert self.popen is not None
        init = Path(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children").read_text()
        os.kill(int(init.split()[0]), signal.SIGKILL)
        self.popen.wait(30)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, FileNotFoundError, IndexError):
                self.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``python -m producer ARGS`` on this host (in its network namespace)."""
        return subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-m",
                               "producer", *args], env=self.env(), capture_output=True,
                              text=True, timeout=300)


def _q(argv: list[str]) -> str:
    return " ".join(f"'{a}'" for a in argv)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


@dataclass
class Cluster:
    r: redis.Redis
    a: Host
    b: Host
    redis_proc: subprocess.Popen[bytes]
    data: Path
    notes: dict[str, float] = field(default_factory=dict)

    def run_id(self) -> str:
        return self.a.farm.run_id()

    def k(self, name: str) -> str:
        return keys.run_key(self.run_id(), name)


def _links(ns: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """(netns, its veth, its address, redis side address) per host; '' netns: the test's."""
    return [(ns["a"], f"hv{TAG}a", "10.213.1.2", "10.213.1.1"),
            (ns["b"], f"hv{TAG}b", "10.213.2.2", "10.213.2.1"),
            ("", f"hv{TAG}t", "10.213.3.2", "10.213.3.1")]


def _make_network(ns: dict[str, str]) -> None:
    for name in ns.values():
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
    for i, (where, veth, addr, redis_addr) in enumerate(_links(ns)):
        peer = f"hv{TAG}r{i}"
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", peer, "netns", ns["redis"])
        sh("ip", "-n", ns["redis"], "addr", "add", f"{redis_addr}/30", "dev", peer)
        sh("ip", "-n", ns["redis"], "link", "set", peer, "up")
        if where:
            sh("ip", "link", "set", veth, "netns", where)
        ip = ["ip", "-n", where] if where else ["ip"]
        sh(*ip, "addr", "add", f"{addr}/30", "dev", veth)
        sh(*ip, "link", "set", veth, "up")


def _drop_stale_networks() -> None:
    """Remove what a test run killed before its teardown (SIGKILL) left: its namespaces, their
    processes, and its veth end here, which holds the fixed 10.213.3.2 this run needs."""
    def dead(tag: str) -> bool:
        return tag != TAG and not Path(f"/proc/{tag}").exists()

    for m in re.finditer(r"^(hs[rab](\d+))\b", sh("ip", "netns", "list").stdout, re.M):
        name, tag = m.groups()
        if dead(tag):
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", name, check=False)
    for m in re.finditer(r"^\d+: hv(\d+)t[@:]", sh("ip", "-o", "link").stdout, re.M):
        if dead(m.group(1)):
            sh("ip", "link", "del", f"hv{m.group(1)}t", check=False)


def _drop_network(ns: dict[str, str]) -> None:
    for name in ns.values():
        sh("ip", "netns", "del", name, check=False)  # its veth ends go with it
    sh("ip", "link", "del", f"hv{TAG}t", check=False)


def _start_redis(ns: str, work: Path) -> subprocess.Popen[bytes]:
    data = work / "redis"
    data.mkdir(parents=True)
    argv = ["ip", "netns", "exec", ns, shutil.which("redis-server") or "redis-server",
            "--port", str(REDIS_PORT), "--bind", "10.213.1.1 10.213.2.1 10.213.3.1",
            "--requirepass", PASSWORD, "--dir", str(data), "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--maxmemory-policy", "noeviction"]
    with open(work / "redis.log", "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _join_run(src: Path, dst: Path) -> None:
    """What the RUNBOOK's rsync does: the run's head files, not its samples or root id."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.name != outdir.ROOT_ID_FILE and not is_temp_name(p.name):
            shutil.copy2(p, dst / p.name)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("hosts")
    ns = {"redis": f"hsr{TAG}", "a": f"hsa{TAG}", "b": f"hsb{TAG}"}
    started: list[Host] = []
    redis_proc = None
    try:
        _drop_stale_networks()
        _make_network(ns)
        redis_proc = _start_redis(ns["redis"], work)
        r = redis.Redis(host="10.213.3.1", port=REDIS_PORT, password=PASSWORD)
        wait_until(lambda: _pings(r), 20, "redis-server in its namespace")
        a, b = (Host(name, ns[x], addr, LocalFarm(work / name, extra_env=dict(ENV)))
                for name, x, addr in (("hostA", "a", "10.213.1.1"),
                                      ("hostB", "b", "10.213.2.1")))
        started += [a, b]
        a.start()  # writes the run's manifest
        _join_run(a.farm.output_dir, b.farm.output_dir)
        b.start()
        data = work / "data.json"
        write_samples(data, N_SAMPLES)
        yield Cluster(r, a, b, redis_proc, data)
    finally:
        for host in started:
            host.stop()
        if redis_proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(redis_proc.pid, signal.SIGKILL)
            redis_proc.wait(10)
        _drop_network(ns)


def _pings(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.RedisError:
        return False


def _running_on(cl: Cluster, host: str) -> set[str]:
    raw = cl.r.hgetall(cl.k(keys.RUNNING))
    return {text(k) for k, v in raw.items()
            if str(json.loads(v).get("worker", "")).startswith(f"{host}:")}


def _held_by(cl: Cluster, key: str) -> str | None:
    raw = cl.r.hget(cl.k(keys.HELD), key)
    return None if raw is None else text(raw).split("|", 1)[0]


def _files(out: Path) -> set[str]:
    return {p.name.removesuffix(DUMP_SUFFIX) for p in (out / "samples").rglob(f"*{DUMP_SUFFIX}")
            if not is_temp_name(p.name)}


def test_a_lost_host_s_samples_run_on_the_other_within_30_s_and_nothing_is_lost_or_doubled(
        cluster: Cluster) -> None:
    cl = cluster
    # Given a run over two hosts, enqueued from host A
    res = cl.a.cli("enqueue", str(cl.data), "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"published: {N_SAMPLES}" in res.stdout
    # When host A has finished some samples and has others running, all of it is SIGKILLed
    wait_until(lambda: len(_files(cl.a.farm.output_dir)) >= 2 and bool(_running_on(cl, "hostA")),
               120, "host A to have done some samples and be running others")
    cl.a.kill()
    t_kill = time.monotonic()
    orphans = _running_on(cl, "hostA")
    done_on_a = _files(cl.a.farm.output_dir)
    assert orphans

    # Then each sample A was running runs on host B (or is done there) within 30 s
    def recovered() -> bool:
        on_b = _running_on(cl, "hostB")
        return all(k in on_b or _held_by(cl, k) == "hostB" for k in orphans)

    wait_until(recovered, 40, "host A's samples to run on host B", poll_s=0.2)
    recover_s = time.monotonic() - t_kill
    cl.notes.update(recover_s=recover_s, orphans=len(orphans))
    assert recover_s <= 30.0, f"took {recover_s:.1f}s"
    # And status names both hosts: A lost, B alive with its server
    st = cl.b.cli("status")
    print(f"\n$ python -m producer status  # on host B, host A lost\n{st.stdout}")
    assert re.search(r"^host hostA +done \d+, running 0, .*; server unknown \(last seen: ok\); "
                     r"heartbeat \d+s ago, LOST; output ", st.stdout, re.M), st.stdout + st.stderr
    assert "host hostB" in st.stdout and "server ok" in st.stdout, st.stdout
    per_host = {h["host"]: h for h in json.loads(cl.b.cli("status", "--json").stdout)["hosts"]}
    assert not per_host["hostA"]["alive"] and per_host["hostB"]["alive"], per_host
    # And the dashboard's data and /metrics say the same per host
    # (read from the test's namespace, where Redis answers at its own address)
    seen_here = {**cl.b.env(), "REDIS_URL": f"redis://:{PASSWORD}@10.213.3.1:{REDIS_PORT}/0"}
    snapshot, metrics = dashboard_metrics(Settings.from_env(seen_here))
    assert {h["host"]: h["alive"] for h in snapshot["status"]["hosts"]} == {
        "hostA": False, "hostB": True}, snapshot["status"]["hosts"]
    assert re.search(r'^hsfarm_host_alive\{run="\w+",host="hostA"\} 0$', metrics, re.M), metrics
    assert re.search(r'^hsfarm_host_alive\{run="\w+",host="hostB"\} 1$', metrics, re.M), metrics
    assert re.search(r'^hsfarm_host_server_up\{run="\w+",host="hostB"\} 1$', metrics, re.M), metrics

    # When host A comes back, its workers resume
    cl.a.start()
    assert "registered" in _read(cl.a.worker_log).decode()
    wait_until(lambda: cl.r.zcard(cl.k(keys.DONE)) >= N_SAMPLES, 180, "every sample done")
    wait_until(lambda: not cl.r.hlen(cl.k(keys.RUNNING)), 30, "nothing running")

    # Then every sample is done exactly once, on one host, and A's files still count; a file
    # A wrote just before the kill, before the run recorded it (so B did it again), is set
    # aside on A when A comes back: kept, out of the training set
    on_a, on_b = _files(cl.a.farm.output_dir), _files(cl.b.farm.output_dir)
    aside = {p.name.removesuffix(DUMP_SUFFIX)
             for p in (cl.a.farm.output_dir / outdir.DONE_ELSEWHERE_DIR).glob(f"*{DUMP_SUFFIX}")}
    assert aside <= done_on_a and aside <= on_b
    assert set(hosts.held_twice(cl.r, cl.run_id())) == aside
    everything = {text(k) for k in cl.r.hkeys(cl.k(keys.SAMPLES))}
    cl.notes.update(duplicates=len(on_a & on_b), lost=len(everything - (on_a | on_b)),
                    set_aside=len(aside),
                    attempts=sum(int(v) for v in cl.r.hvals(cl.k(keys.ATTEMPTS))),
                    on_a=len(on_a), on_b=len(on_b))
    assert len(everything) == N_SAMPLES
    assert not on_a & on_b, f"done on both hosts: {sorted(on_a & on_b)}"
    assert on_a | on_b == everything
    assert done_on_a - aside <= on_a and all(_held_by(cl, k) == "hostA" for k in on_a)
    assert not cl.r.hlen(cl.k(keys.FAILED))
    returned = _read(cl.b.worker_log).decode().count("to the queue")
    cl.notes.update(redeliveries=returned)
    print(f"\nhost loss: {N_SAMPLES} samples, {len(orphans)} running on A at the kill, "
          f"{returned} messages returned by B's reaper, recovered in {recover_s:.1f}s, "
          f"attempts {cl.notes['attempts']}, files A {len(on_a)} / B {len(on_b)}, "
          f"done twice and set aside {len(aside)}, duplicates {len(on_a & on_b)}, "
          f"lost {cl.notes['lost']}")


def test_after_redis_lost_everything_enqueue_waits_for_the_hosts_it_has_not_heard_from(
        cluster: Cluster) -> None:
    cl = cluster
    on_b = _files(cl.b.farm.output_dir)
    assert on_b, "the first test leaves files on host B"
    # Given host B is down and Redis lost everything
    cl.b.kill()
    cl.r.flushall()
    # When enqueue runs on host A
    res = cl.a.cli("enqueue", str(cl.data), "--no-progress")
    # Then it publishes nothing, and names host B
    assert res.returncode == 2, res.stdout + res.stderr
    assert "hostB" in res.stderr and "--redo-host hostB" in res.stderr
    assert "Nothing was published" in res.stderr
    print(f"\n$ python -m producer enqueue  # Redis lost, host B down\n{res.stderr}")
    # And told that host B is gone for good, it would extract B's samples again (dry run)
    res = cl.a.cli("enqueue", str(cl.data), "--no-progress", "--dry-run", "--redo-host", "hostB")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"published: {N_SAMPLES - len(_files(cl.a.farm.output_dir))}\n" in res.stdout, res.stdout
    # When host B's workers start again, they register what its output dir holds
    cl.b.start()
    wait_until(lambda: "hostB" in hosts.hosts(cl.r, cl.run_id())
               and "registered_at" in hosts.hosts(cl.r, cl.run_id())["hostB"], 30,
               "host B to register its files")
    # Then enqueue publishes nothing: every sample is done, B's on B
    res = cl.a.cli("enqueue", str(cl.data), "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "published: 0" in res.stdout
    assert f"already done: {N_SAMPLES} ({len(on_b)} on other hosts)" in res.stdout
    print(f"\n$ python -m producer enqueue  # host B back\n{res.stdout}")
    # And audit on A checks A's files and names what the run places on B
    res = cl.a.cli("audit", "--data", str(cl.data))
    assert f"on other hosts: {len(on_b)} (hostB {len(on_b)};" in res.stdout, res.stdout
    assert res.returncode == 0, res.stdout
    print(f"\n$ python -m producer audit  # on host A\n{res.stdout}")
    print(_read(cl.b.worker_log).decode().count("registered"), [
        x for x in _read(cl.b.worker_log).decode().splitlines() if "registered" in x])


def test_a_file_done_on_two_hosts_is_set_aside_where_it_was_not_recorded(
        cluster: Cluster) -> None:
    cl = cluster
    # Given a sample the run records as done on host B, whose file host A also wrote (A was
    # lost after writing it, before the run learnt so)
    key = sorted(_files(cl.b.farm.output_dir))[0]
    a_out = cl.a.farm.output_dir
    copy = outdir.final_path(a_out, key)
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(outdir.final_path(cl.b.farm.output_dir, key), copy)
    # When host A registers its files (as its workers do when they start)
    fingerprint_id = json.loads((a_out / "manifest.json").read_text())["fingerprint_id"]
    got = hosts.register(cl.r, cl.run_id(), "hostA", a_out, fingerprint_id,
                         Settings.from_env(cl.a.env()))
    # Then A's copy is set aside (kept, out of the training set), B's counts
    assert got.set_aside == 1 and not copy.exists()
    assert (a_out / outdir.DONE_ELSEWHERE_DIR / copy.name).is_file()
    assert hosts.held_twice(cl.r, cl.run_id())[key]["kept"] == "hostB"
    assert _held_by(cl, key) == "hostB"


def _cut_off(host: Host, on: bool) -> None:
    """The host's own firewall drops (``on``) or passes everything on its veth to Redis."""
    veth = {"hostA": f"hv{TAG}a", "hostB": f"hv{TAG}b"}[host.name]
    if on:
        rules = (f"table inet cut{TAG} {{\n"
                 f"  chain i {{ type filter hook input priority 0; iifname \"{veth}\" drop; }}\n"
                 f"  chain o {{ type filter hook output priority 0; oifname \"{veth}\" drop; }}\n"
                 "}\n")
        subprocess.run(["ip", "netns", "exec", host.netns, "nft", "-f", "-"], input=rules,
                       text=True, check=True, capture_output=True, timeout=60)
    else:
        sh("ip", "netns", "exec", host.netns, "nft", "delete", "table", "inet", f"cut{TAG}")


@pytest.mark.skipif(shutil.which("nft") is None, reason="needs nft(8) for a host's firewall")
def test_a_host_cut_off_from_redis_for_60_s_leaves_no_outcome_after_done(
        cluster: Cluster) -> None:
    cl = cluster
    # Given samples of a second data file running on both hosts
    data = cl.data.with_name("data-cut.json")
    sample_keys = {str(s["id"]) for s in write_samples(data, 12, start=N_SAMPLES)}
    res = cl.a.cli("enqueue", str(data), "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    wait_until(lambda: bool(_running_on(cl, "hostA") & sample_keys), 120,
               "host A to run samples of the file")
    # When host A's firewall cuts it off from Redis for 60 s
    _cut_off(cl.a, True)
    try:
        time.sleep(60)
    finally:
        _cut_off(cl.a, False)
    # Then every sample is done, and none has an outcome beside done: status --check passes
    def index_done() -> set[str]:
        return {text(k) for k in cl.r.zrange(cl.k(keys.DONE), 0, -1)}  # type: ignore[arg-type]

    wait_until(lambda: sample_keys <= index_done(), 300, "every sample of the file done")
    wait_until(lambda: not _running_on(cl, "hostA") and not _running_on(cl, "hostB"), 120,
               "nothing running")
    time.sleep(5)  # what host A still had to say once it reached Redis again
    done = index_done()
    late = {name: sorted({text(k) for k in cl.r.hkeys(cl.k(name))} & done)
            for name in (keys.RETRYING, keys.FAILED, keys.REJECTED, keys.STALE)}
    st = cl.b.cli("status", "--check")
    print(f"\n$ python -m producer status --check  # host A was cut off 60 s\n{st.stdout}"
          f"outcomes after done: {late}")
    assert not any(late.values()), late
    assert st.returncode == 0, st.stdout + st.stderr
