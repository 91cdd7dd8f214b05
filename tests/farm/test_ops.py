"""ops/ against real processes: preflight on a private Redis (one per module) before anything is
done and with the plugin checks, GPU holders named, the launcher's dry run, the reference
server's dead marker gone after a restart, and each Dockerfile copying what the package needs.
The GPU is the one thing this machine lacks: a stand-in nvidia-smi goes on PATH, said so.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_dump.dumpfile import READY_PREFIX
from producer.localfarm.farm import LocalFarm
from tests.conftest import CACHE, private_redis, write_samples
from tests.support.ops import OPS, ROOT, clean_env, sh


@pytest.fixture(scope="module")
def redis_farm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFarm]:
    """A private Redis (AOF always), nothing else."""
    with private_redis(tmp_path_factory.mktemp("ops") / "farm") as farm:
        yield farm


# --- preflight ---------------------------------------------------------------------------------


def test_preflight_before_anything_is_done_changes_nothing_and_says_it_cannot_size(
        redis_farm: LocalFarm, tiny_model: Path, tmp_path: Path) -> None:
    # Given a run enqueued (no worker yet: nothing done), the server not started, and output
    # and dump dirs that do not exist yet
    out, dumps = tmp_path / "new" / "out", Path(f"/dev/shm/hsfarm-test-{os.getpid()}") / "d"
    env = clean_env(REDIS_URL=redis_farm.env()["REDIS_URL"], FARM_MODEL_PATH=str(tiny_model),
                    FARM_OUTPUT_DIR=str(out), FARM_DUMP_DIR=str(dumps),
                    FARM_SERVER_URL="http://127.0.0.1:9", FARM_QUEUE="ops-nothing-done")
    data = tmp_path / "data.json"
    write_samples(data, 3)
    res = subprocess.run([sys.executable, "-m", "producer", "enqueue", str(data),
                          "--no-progress"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # When preflight runs
    res = sh("ops/preflight.sh", env=env)
    lines = res.stdout.splitlines()
    # Then every line is one check with its level, the run is found from FARM_MODEL_PATH, the
    # output disk says plainly that it is not sized yet, and the unreachable server FAILs
    assert all(re.match(r"(OK|WARN|FAIL) +\S", line) for line in lines), res.stdout
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert any(line.startswith("FAIL  server at http://127.0.0.1:9 does not answer")
               for line in lines)
    assert any(re.match(r"OK    run \w{16} \(from model .*\): 0 of 3 samples done, 3 without "
                        r"an outcome$", line) for line in lines), res.stdout
    assert any(line.startswith(f"WARN  output disk {out}: ")  # enqueue began the run there
               and "not sized to the run: no sample is done yet" in line
               and "each token takes 528 bytes" in line for line in lines), res.stdout
    assert any(line.startswith(f"OK    dump dir {dumps} (not created yet: the server makes "
                               "it; /dev/shm)") for line in lines), res.stdout
    assert f"FAIL  ready marker: no dump dir {dumps}" in res.stdout
    # And it created nothing (the output dir and its manifest are enqueue's)
    assert not dumps.parent.exists()


def test_preflight_says_when_the_plugin_checks_did_not_run_and_runs_them_with_sglang_python(
        redis_farm: LocalFarm) -> None:
    # Given this host's python, which has no SGLang
    env = clean_env(REDIS_URL=redis_farm.env()["REDIS_URL"])
    # When preflight runs without, then with SGLANG_PYTHON
    plain = sh("ops/preflight.sh", env=env)
    given = sh("ops/preflight.sh", env={**env, "SGLANG_PYTHON": sys.executable})
    # Then it says the checks did not run, and with it, runs verify there: that python's
    # FAIL comes through as a FAIL line of preflight
    assert "WARN  plugin checks NOT run: SGLang is not installed in this python" in plain.stdout
    assert f"FAIL  sglang: SGLang is not installed here ({sys.executable})" in given.stdout
    assert given.returncode == 1


FAKE_SMI = """#!/bin/sh
# a stand-in for nvidia-smi (this machine has no GPU): two GPUs, held by the pids given
case "$1" in
  --query-gpu=*) printf '0, GPU-a, NVIDIA H200, 70000\\n1, GPU-b, NVIDIA H200, 70000\\n' ;;
  --query-compute-apps=gpu_uuid*) for p in $HOLDERS; do printf 'GPU-a, %s, x, 1\\n' "$p"; done ;;
  --query-compute-apps=pid*) for p in $HOLDERS; do printf '%s, x\\n' "$p"; done ;;
  -L) printf 'GPU 0: H200\\nGPU 1: H200\\n' ;;
esac
"""


def test_gpu_holders_are_named_with_their_command_and_unit(tmp_path: Path) -> None:
    # Given GPUs (a stand-in nvidia-smi: no GPU here) held by a real process that is not the
    # farm's SGLang, and by one whose command line is SGLang's
    (tmp_path / "nvidia-smi").write_text(FAKE_SMI)
    (tmp_path / "nvidia-smi").chmod(0o755)
    other = subprocess.Popen(["sleep", "60"])
    ours = subprocess.Popen(["bash", "-c", "exec -a sglang.launch_server sleep 60"])
    env = clean_env(PATH=f"{tmp_path}:{Path(sys.executable).parent}:{os.environ['PATH']}")
    probe = ("from producer.preflight import check_gpus; print(check_gpus())")
    try:
        # When preflight's GPU check and the launcher's dry run look
        both = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env={**env, "HOLDERS": f"{other.pid} {ours.pid}"}, timeout=30)
        mine = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env={**env, "HOLDERS": str(ours.pid)}, timeout=30)
        launch = sh("ops/launch-sglang.sh", "--dry-run", env={
            **env, "HOLDERS": str(other.pid), "FARM_MODEL_PATH": str(tmp_path),
            "PYTHON": sys.executable, "FARM_SERVER_URL": "http://127.0.0.1:9"})
    finally:
        for p in (other, ours):
            p.kill()
            p.wait()
    # Then a foreign holder FAILs with its pid, command and unit; SGLang alone is OK
    assert both.stdout.startswith("FAIL  GPUs: 2 x NVIDIA H200; GPU 0: pid "), both.stdout
    assert f"pid {other.pid} (sleep 60; " in both.stdout and "NOT the farm's server" in both.stdout
    assert mine.stdout.startswith(f"OK    GPUs: 2 x NVIDIA H200; GPU 0: pid {ours.pid} "
                                  "(sglang.launch_server 60; "), mine.stdout
    assert f"FAIL  GPUs are in use by: pid {other.pid} x (" in launch.stdout, launch.stdout


# --- the launcher ------------------------------------------------------------------------------


def test_launcher_dry_run_checks_everything_and_starts_and_removes_nothing(
        redis_farm: LocalFarm, tiny_model: Path, tmp_path: Path) -> None:
    # Given a dump dir holding a dead server's marker, and a port already taken (Redis's)
    dumps = Path(f"/dev/shm/hsfarm-test-launch-{os.getpid()}")
    dumps.mkdir()
    try:
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from engine_dump.markers import write_ready_marker; "
                        "write_ready_marker(Path(sys.argv[1]), {})", str(dumps)], check=True)
        before = sorted(p.name for p in dumps.iterdir())
        env = clean_env(FARM_MODEL_PATH=str(tiny_model), FARM_DUMP_DIR=str(dumps),
                        FARM_SERVER_URL=f"http://127.0.0.1:{redis_farm.redis_port}",
                        FARM_LAYERS_TO_CAPTURE="2,4,5", SGLANG_TP="1", PYTHON=sys.executable)
        # When the launcher's dry run looks, with an extra SGLang flag
        res = sh("ops/launch-sglang.sh", "--dry-run", "--", "--mem-fraction-static", "0.5",
                 env=env)
        # Then each check has its line, the taken port and the missing SGLang FAIL, and the
        # exact command follows
        out = res.stdout
        assert res.returncode == 1, out + res.stderr
        assert f"OK    model dir {tiny_model}\n" in out
        assert f"FAIL  sglang: SGLang is not installed here ({sys.executable})" in out
        assert f"FAIL  port {redis_farm.redis_port}: something already listens there" in out
        assert f"OK    dump dir {dumps} is on tmpfs" in out
        assert (f"OK    ready markers: ready markers in {dumps}: 1, of dead processes: 1 (the "
                "dead ones are removed at start)") in out
        assert out.endswith(
            f"would run, once the FAILs above are fixed:\nSGLANG_HS_DUMP_DIR={dumps} "
            f"{sys.executable} -m sglang.launch_server --model-path {tiny_model} --tp-size 1 "
            f"--port {redis_farm.redis_port} --host 127.0.0.1 --disable-radix-cache "
            "--disable-prefill-cuda-graph --skip-server-warmup --enable-return-aux-hidden-states "
            "--speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids 2 4 5 "
            "--trust-remote-code --mem-fraction-static 0.5\n")
        # And nothing was started or removed
        assert sorted(p.name for p in dumps.iterdir()) == before
        assert "sglang.launch_server" not in subprocess.run(
            ["ps", "-eo", "args"], capture_output=True, text=True).stdout.replace(
            "-m sglang.launch_server --model-path", "")
    finally:
        shutil.rmtree(dumps)


# --- deployment files agree with the settings table ----------------------------------------


def test_dead_marker_of_the_reference_server_is_gone_after_a_restart(
        tmp_path: Path, tiny_model: Path) -> None:
    # Given a dump dir with the marker of a server process that died
    dumps = tmp_path / "dumps"
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                    "from engine_dump.markers import write_ready_marker; "
                    "write_ready_marker(Path(sys.argv[1]), {})", str(dumps)], check=True)
    [dead] = list(dumps.glob(f"{READY_PREFIX}*"))
    # When a reference server starts there
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, dumps=dumps)
    try:
        server = farm.start_server()
        # Then only its own marker is left
        assert [p.name for p in dumps.glob(f"{READY_PREFIX}*")] == \
            [f"{READY_PREFIX}{server.pid}"]
        assert not dead.exists()
    finally:
        farm.close(kill=True)


@pytest.mark.parametrize("dockerfile", ["Dockerfile.worker", "Dockerfile.sglang"])
def test_each_dockerfile_copies_what_the_package_needs(tmp_path: Path, dockerfile: str) -> None:
    """No Docker engine here: lay out the image's context as its COPY lines do, then build the
    wheel its ``pip install .`` would build (a package left out fails the build)."""
    lines = (OPS / dockerfile).read_text().splitlines()
    copies = [line.split()[1:] for line in lines if line.startswith("COPY ")]
    assert copies, f"{dockerfile} copies nothing"
    for *sources, dest in copies:
        for src in sources:
            # COPY a b/ (or ./) puts a inside b; COPY a b names the copy b
            target = tmp_path / dest / Path(src).name if dest.endswith("/") else tmp_path / dest
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / src, target)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheel"), str(tmp_path)],
        capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
