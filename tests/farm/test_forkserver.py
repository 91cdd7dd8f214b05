"""The suite's reference servers are forks of its fork server (tests/support/forkserver.py),
also once this process has imported torch and transformers itself (torch's dynamo then sets a
variable of its own: a fork server that refused every start from then on would cost the suite
~10 minutes of CPU and fail nothing)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from producer.localfarm import farm as localfarm
from tests.conftest import served_farm
from tests.support.forkserver import ForkedChild, ForkServer

VAR = "TORCHINDUCTOR_CACHE_DIR"
RUNTIME_VAR = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


@pytest.mark.skipif(os.environ.get("HSFARM_TEST_FORKSERVER") == "0",
                    reason="HSFARM_TEST_FORKSERVER=0: servers start plainly")
def test_a_farms_server_is_forked_after_torch_is_imported_here(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a fork server begun in a process that had not imported torch's dynamo
    fork_server = ForkServer()
    monkeypatch.setattr(localfarm, "launcher", fork_server)
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.delenv(RUNTIME_VAR, raising=False)
    try:
        for name in ("before", "after", "runtime", "again"):
            # When a farm starts its server (a plain start's CPU is ~6 s, a fork's ~0.4 s)
            with served_farm(tmp_path / name) as farm:
                # Then the server is a fork server's child, ready as the server it became
                server = farm.procs["server"]
                assert isinstance(server.popen, ForkedChild), server.popen
                assert any(farm.dump_dir.glob(".ready.*")) and server.alive()
            if name == "before":
                # And when this process then imports torch's dynamo too (as many tests do),
                # which sets VAR here as it did in the fork server, the next forks the same
                after = fork_server.zygotes[0].env_after
                assert fork_server.zygotes[0].env_before.get(VAR) is None and after[VAR]
                monkeypatch.setenv(VAR, after[VAR])
            elif name == "after":
                # And when this process sets a variable of transformers' that no preload
                # reads (chat.py does), the next forks from a second server begun with it
                assert len(fork_server.zygotes) == 1
                monkeypatch.setenv(RUNTIME_VAR, "1")
        assert len(fork_server.zygotes) == 2  # "again" forked from the second one
        assert (fork_server.forked, fork_server.plain) == (4, 0)
    finally:
        fork_server.close()
