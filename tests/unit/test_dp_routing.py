"""The worker's choice of a DP group: the rules, and admission choosing under its lock."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from producer.localfarm.farm import wait_until
from worker.core.errors import ConfigError
from worker.core.settings import Settings
from worker.server.admission import Admission, Holding, Limits
from worker.server.dp_routing import LEAST_BYTES, LEAST_TOKENS, NO_GROUP, SERVER, choose_group


def test_the_rules_pick_the_group_with_the_least_waiting_tokens_or_held_bytes() -> None:
    # Given group 0 holding one big answered dump, group 1 a smaller request still waiting
    held = [Holding(0, 900, 0), Holding(1, 300, 1), Holding(1, 100, NO_GROUP)]
    # Then least-tokens sends the next request to group 0 (nothing waiting there) ...
    assert choose_group(LEAST_TOKENS, 2, held) == 0
    # ... least-bytes to group 1 (less of its dumps in tmpfs), and a third, empty group wins
    assert choose_group(LEAST_BYTES, 2, held) == 1
    assert choose_group(LEAST_TOKENS, 3, held) == choose_group(LEAST_BYTES, 3, held) == 2
    # And ties go to the lowest group; no pin for SGLang's own dispatch or without groups
    assert choose_group(LEAST_TOKENS, 4, []) == 0
    assert choose_group(SERVER, 4, held) == choose_group(LEAST_TOKENS, 1, held) == NO_GROUP
    with pytest.raises(ValueError, match="unknown DP routing rule"):
        choose_group("random", 2, held)
    with pytest.raises(ConfigError, match="FARM_DP_ROUTING must be one of server, "):
        Settings(dp_routing="random")


def test_admission_pins_each_ticket_to_the_least_loaded_group_across_processes(
        tmp_path: Path) -> None:
    # Given 2 DP groups and another worker process holding a 50-token request (group 0)
    limits = Limits(8, 10_000_000, 100, "test", dp_groups=2)
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from worker.server.admission import Admission, Limits
        a = Admission(Path({str(tmp_path)!r}), Limits(8, 10_000_000, 100, "test", dp_groups=2),
                      60, dp_routing="least-tokens")
        with a.admit(50) as t:
            print(t.dp_rank, flush=True)
            sys.stdin.read()
    """)
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "0"
        admission = Admission(tmp_path, limits, wait_s=1, dp_routing=LEAST_TOKENS)
        # When this process takes tickets for 20 and then 40 tokens
        with admission.admit(20) as small, admission.admit(40) as second:
            # Then the first goes to the idle group 1, the second to group 1 again (20 < 50)
            assert (small.dp_rank, second.dp_rank) == (1, 1)
            # And once group 1's are answered, group 1 has nothing waiting: the next goes there
            small.answered()
            second.answered()
            with admission.admit(10) as third:
                assert third.dp_rank == 1
        # And the other process's release frees its group's load at once
        other.communicate("", timeout=30)
        wait_until(lambda: admission.usage() == Holding(0, 0), 10, "the slot to free")
        with admission.admit(1) as fresh:
            assert fresh.dp_rank == 0
    finally:
        other.kill()
    # And without groups, or with SGLang's own dispatch, no ticket is pinned
    for a in (Admission(tmp_path, Limits(8, 10_000, 100, "t"), 1, dp_routing=LEAST_TOKENS),
              Admission(tmp_path, limits, 1, dp_routing=SERVER)):
        with a.admit(1) as t:
            assert t.dp_rank is None
