"""Launches the hook must refuse or cannot see, and what ``verify`` says about them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.live.conftest import running
from tests.live.sglang_server import HOOK_FLAGS, LiveServer, sglang_python


def _verify(python: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "sglang_patch", "verify", *args],
                          capture_output=True, text=True, timeout=600)


def test_radix_cache_on_is_refused_at_start_up_with_the_fix(tmp_path: Path,
                                                            tiny_model: Path) -> None:
    # Given a launch with the hook's variable but the radix (prefix) cache left on
    flags = [f for f in HOOK_FLAGS if f != "--disable-radix-cache"]
    server = LiveServer(tiny_model, tmp_path, tmp_path / "dumps", flags=flags)
    # When SGLang starts it
    server.launch()
    try:
        code = server.wait_exit()
    finally:
        server.stop()
    # Then the server exits during start-up, the log names the reason and the fix, and the
    # hook never came up (no marker)
    log = server.log.read_text(errors="replace")
    assert code != 0
    assert "LayoutError: hsfarm dump hook cannot run with this launch" in log
    assert "add --disable-radix-cache" in log
    assert not server.markers()


def test_a_server_without_the_plugin_fails_verify(tmp_path: Path, tiny_model: Path) -> None:
    # Given a live server launched without SGLANG_HS_DUMP_DIR (the plugin does nothing)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    with running(LiveServer(tiny_model, tmp_path, None), "TP=1 without the plugin") as server:
        # When verify checks it against the dump dir the farm would use (from the worker's
        # python: the live checks need neither SGLang nor torch)
        res = _verify(sys.executable, "--live-only", "--dump-dir", str(dumps),
                      "--server", server.url, "--timeout-s", "5")
        # Then both live checks fail, each saying what to do, and nothing was written
        assert res.returncode == 1, res.stdout
        assert f"FAIL  ready marker: none in {dumps}: start the server with " \
               f"SGLANG_HS_DUMP_DIR={dumps}" in res.stdout
        assert "FAIL  probe request: the server answered the probe but no dump of it " \
               "appeared" in res.stdout
        assert "SGLANG_HS_DUMP_DIR unset" in res.stdout
        assert list(dumps.iterdir()) == []


def test_verify_where_sglang_is_not_installed() -> None:
    # Given this interpreter (the farm's), which has hsfarm but not SGLang
    assert sglang_python() != Path(sys.executable)
    # When the install checks run here
    res = _verify(sys.executable)
    # Then verify says so, and where to run it instead
    assert res.returncode == 1
    assert res.stdout.startswith(f"FAIL  sglang: SGLang is not installed here ({sys.executable})")
    assert "run verify with the python that runs sglang.launch_server" in res.stdout
