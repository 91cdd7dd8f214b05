"""What NCCL chose for a server, read from its INFO logs (engine_dump/nccl.py), as the
launchers and preflight report it. The logs are fixtures in NCCL's INFO format
(tests/support/nccl/README.md): no GPU here to produce them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine_dump import nccl

LOGS = Path(__file__).resolve().parents[1] / "support" / "nccl"
ROOT = Path(__file__).resolve().parents[2]


def test_the_two_channel_ring_of_a_misread_pcie_box_is_a_warning_with_the_fix() -> None:
    # Given the INFO logs of 8 GPUs whose ring NCCL built with 2 channels through the CPU
    setup = nccl.read_dir(LOGS / "slow-ring")
    # When they are read
    level, text = nccl.verdict(setup)
    # Then what NCCL chose is named, and it is a WARN with both fixes
    assert (setup.version, setup.local_ranks, setup.narrowest_ring) == ("2.21.5+cuda12.4", 8, 2)
    assert setup.transports == {"SHM"} and setup.ring_types == {"SYS/PIX"}
    assert level == "WARN"
    assert text.startswith("NCCL: NCCL 2.21.5+cuda12.4, 8 GPUs per node, ring 2 channels "
                           "(path SYS), via SHM: a ring of 2 channels over 8 GPUs")
    for fix in ("NCCL_TOPO_FILE", "NCCL_GRAPH_FILE", "NCCL_MIN_NCHANNELS=16",
                "NCCL_MAX_NCHANNELS=32", "NVIDIA/nccl PR #2127"):
        assert fix in text


def test_a_ring_given_its_graph_is_ok_and_says_the_settings_nccl_read() -> None:
    setup = nccl.read_dir(LOGS / "graph-file")
    level, text = nccl.verdict(setup)
    assert level == "OK" and setup.narrowest_ring == 16 and setup.transports == {"P2P"}
    assert text == ("NCCL: NCCL 2.21.5+cuda12.4, 8 GPUs per node, ring 16 channels (path PIX), "
                    "via P2P, set: NCCL_BUFFSIZE=8388608 "
                    "NCCL_GRAPH_FILE=/etc/hsfarm/nccl-graph.xml NCCL_MAX_NCHANNELS=32")


def test_lines_that_are_not_nccl_info_are_skipped_and_none_is_a_warning() -> None:
    setup = nccl.parse(["INFO 12-05 launch_server: starting", "gpu:1:1 [0] NCCL WARN Cuda failure",
                        "Channel 00/02 :    0   1"])
    assert setup.lines == 0
    level, text = nccl.verdict(setup)
    assert level == "WARN" and "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH" in text
    # And two GPUs on a thin ring are no slow-ring symptom (it needs 4 GPUs or more)
    two = nccl.parse(["h:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 2 nNodes 1 localRanks 2 "
                      "localRank 0 MNNVL 0",
                      "h:1:1 [0] NCCL INFO Pattern 4, crossNic 0, nChannels 2, bw 20.000000/"
                      "20.000000, type NVL/PIX, sameChannels 1"])
    assert nccl.verdict(two)[0] == "OK"


def test_the_settings_shown_are_the_nccl_ones_a_person_gave() -> None:
    env = {"NCCL_MAX_NCHANNELS": "32", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "x",
           "NCCL_BUFFSIZE": "8388608", "PATH": "/bin"}
    assert nccl.tuning(env) == {"NCCL_BUFFSIZE": "8388608", "NCCL_MAX_NCHANNELS": "32"}
    assert nccl.log_dirs(30000, {"HSFARM_NCCL_LOG_DIR": "/x"}) == [Path("/x")]
    assert nccl.log_dirs(30000, {"TMPDIR": "/t"}) == [Path("/var/log/hsfarm/nccl-30000"),
                                                      Path("/t/hsfarm-nccl-30000")]


def test_both_hooks_cli_print_the_line() -> None:
    for hook in ("sglang_patch", "vllm_hook"):
        res = subprocess.run([sys.executable, "-m", hook, "nccl", "--log-dir",
                              str(LOGS / "slow-ring")], capture_output=True, text=True,
                             timeout=60, cwd=ROOT)
        assert res.returncode == 0 and res.stdout.startswith("WARN  NCCL: NCCL 2.21.5"), res
        gone = subprocess.run([sys.executable, "-m", hook, "nccl", "--log-dir", "/nonexistent"],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert gone.returncode == 2 and "FAIL  NCCL: no log dir /nonexistent" in gone.stdout


def test_preflight_says_what_nccl_chose_for_the_running_server(tmp_path: Path) -> None:
    from producer.preflight import check_collectives
    from worker.core.settings import Settings

    # Given the launcher's NCCL log dir of a server on the slow ring, and a setting given
    env = {"HSFARM_NCCL_LOG_DIR": str(LOGS / "slow-ring"), "NCCL_BUFFSIZE": "4194304"}
    # When preflight checks the collectives, Then a WARN with the settings and the fix
    line = check_collectives(Settings(), env)
    assert line.level == "WARN", line
    assert str(line).startswith("WARN  collectives: NCCL_BUFFSIZE=4194304; NCCL: NCCL 2.21.5")
    assert f"(from {LOGS / 'slow-ring'})" in str(line)
    # And without a log (one GPU, or no server started by a launcher) it says so, OK
    empty = check_collectives(Settings(), {"HSFARM_NCCL_LOG_DIR": str(tmp_path)})
    assert empty.level == "OK" and "no NCCL_* setting given; no NCCL log" in empty.text
