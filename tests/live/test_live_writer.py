"""One live server (TP=1): no request can stall its dump writer, and so the server.

A request whose rid is too long for a file name once ended the writer's thread (its ``.err``
could not be named either); every later request of ours then waited on the writer inside the
scheduler's forward, for good, while ``/health`` still said 200."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_dump.rids import NO_RUN, RID_PREFIX
from tests.live.conftest import measured, running
from tests.live.sglang_server import LiveServer
from tests.live.traffic import ours, prompt, vocab_size, wait_dump

DUMP_WAIT_S = 60  # a dump of a 40-token prompt takes well under a second on this machine


@pytest.fixture(scope="module")
def server(module_dir: Path, tiny_model: Path) -> Iterator[LiveServer]:
    with running(LiveServer(tiny_model, module_dir, module_dir / "dumps"), "TP=1") as server:
        yield server


@pytest.mark.timeout(600)
def test_a_rid_too_long_for_a_file_name_stalls_nothing(server: LiveServer,
                                                        tiny_model: Path) -> None:
    # Given a request whose rid looks like ours but carries a 300-character sample key
    vocab = vocab_size(tiny_model)
    n = 40
    too_long = f"{RID_PREFIX}{NO_RUN}-{'k' * 300}-a1-n{n}"
    # When the server serves it, then eight requests of ours, one after the other
    server.generate(too_long, prompt(n, 1, vocab), timeout_s=120)
    t0 = time.monotonic()
    for i in range(8):
        req = ours(f"after-{i}", n, 10 + i, vocab)
        server.generate(req.rid, req.ids, timeout_s=DUMP_WAIT_S)
        # Then each gets its dump: the writer lives on and the scheduler never waits on it
        wait_dump(server.dumps, req.rid, timeout_s=DUMP_WAIT_S)
    measured(f"8 requests after a 300-character key: all dumped in {time.monotonic() - t0:.1f}s")
    # And nothing of the long rid was written, and verify finds the hook healthy
    assert not [p for p in server.dumps.iterdir() if "kkkk" in p.name]
    res = subprocess.run([sys.executable, "-m", "sglang_patch", "verify", "--live-only",
                          "--dump-dir", str(server.dumps)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("PASS  ready marker: pid "), \
        res.stdout + res.stderr
