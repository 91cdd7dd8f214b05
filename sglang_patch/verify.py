"""``python -m sglang_patch verify [--dump-dir D [--server URL]]``: does SGLang run our hook?

With the server's interpreter; one line per check, PASS or FAIL with the fix; exit 0 only when
all pass. Install checks: SGLang's version, its plugin loader applying ours, each hook target's
parameters, the launch flags under its own parser. Live checks (no SGLang needed here): a fresh
ready marker of every DP group of the newest server start (``--dump-dir``), one request of ours
per group dumped right (``--server``, ``probe``). ``--live-only`` skips the install checks: what
launch-sglang.sh polls. Test: tests/sglang/test_plugin.py::test_verify_passes_on_this_install
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import pkgutil
import subprocess
import sys

from engine_dump.live_check import Check, add_live_args, verify_main
from sglang_patch.layout import REQUIRED_FLAGS, SUPPORTED_SGLANG, sglang_version, version_problem
from sglang_patch.plugin import ENV_DUMP_DIR, EXPECTED_PARAMS, TARGET_LOGITS


def check_version() -> Check:
    v = sglang_version()
    if v in SUPPORTED_SGLANG:
        return Check("sglang version", True, v)
    too_old = version_problem(v)
    if too_old:
        return Check("sglang version", False, too_old)
    return Check("sglang version", False,
                 f"{v} is not supported (supported: {', '.join(SUPPORTED_SGLANG)}); install "
                 f"sglang=={SUPPORTED_SGLANG[-1]} or check the hook targets below by hand")


_LOADER_PROBE = f"""
import os, sys
os.environ[{ENV_DUMP_DIR!r}] = os.environ.get({ENV_DUMP_DIR!r}) or "/tmp/hsfarm-verify"
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
hooked = sorted(t for t, hooks in HookRegistry._hooks.items()
                if any(getattr(h, "__module__", "") == "sglang_patch.plugin" for _, h, _ in hooks))
import pkgutil
fn = pkgutil.resolve_name({TARGET_LOGITS!r})
print("HOOKED", ",".join(hooked), "WRAPPED", getattr(fn, "__wrapped__", None) is not None)
"""


def check_loader(python: str = sys.executable) -> Check:
    """Runs SGLang's ``load_plugins`` in a fresh process of this interpreter."""
    try:
        proc = subprocess.run([python, "-c", _LOADER_PROBE], capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        return Check("plugin loader", False, "load_plugins() did not return in 300 s")
    out = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    expected = ",".join(sorted(EXPECTED_PARAMS))
    if proc.returncode == 0 and out == f"HOOKED {expected} WRAPPED True":
        return Check("plugin loader", True,
                     f"SGLang's load_plugins() applied all {len(EXPECTED_PARAMS)} hsfarm hooks")
    why = out or proc.stderr.strip().splitlines()[-1:] or ["no output"]
    return Check("plugin loader", False,
                 f"SGLang did not apply the hsfarm plugin ({why}); install this project into "
                 f"this interpreter ({python} -m pip install hsfarm[server]) so its "
                 "'sglang.srt.plugins' entry point is visible, and do not set SGLANG_PLUGINS "
                 "without 'hsfarm_dump'")


def check_targets() -> Check:
    problems = []
    for target, expected in EXPECTED_PARAMS.items():
        try:
            fn = pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as e:
            problems.append(f"{target} is missing ({e})")
            continue
        fn = inspect.unwrap(fn)
        params = list(inspect.signature(fn).parameters)[: len(expected)]
        if params != expected:
            problems.append(f"{target} takes {params}, expected {expected}")
    if problems:
        return Check("hook targets", False, "; ".join(problems) +
                     " — this SGLang changed the code the hook relies on; pin a supported one")
    return Check("hook targets", True, ", ".join(sorted(EXPECTED_PARAMS)))


def check_flags() -> Check:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", "/models/x", "--tp-size", "8", *REQUIRED_FLAGS]
    try:
        _, unknown = parser.parse_known_args(argv)
    except SystemExit:
        return Check("launch flags", False, f"this SGLang rejects {' '.join(REQUIRED_FLAGS)}")
    if unknown:
        return Check("launch flags", False, f"unknown to this SGLang: {unknown}")
    return Check("launch flags", True, " ".join(REQUIRED_FLAGS))


def sglang_missing() -> str | None:
    """Why there is no usable SGLang in this interpreter, or None when there is one.

    Installed means: its package metadata is present and ``sglang.srt`` imports. A directory
    named ``sglang`` on the path (a source checkout in the current directory) is not SGLang.
    """
    here = sys.executable
    fix = ("run verify with the python that runs sglang.launch_server, with hsfarm installed "
           "in it")
    version = sglang_version()
    spec = importlib.util.find_spec("sglang")
    if not version:
        if spec is None:
            return f"SGLang is not installed here ({here}): {fix}"
        where = ", ".join(str(x) for x in (spec.submodule_search_locations or [str(spec.origin)]))
        return (f"SGLang is not installed here ({here}); the 'sglang' on the path is {where}, "
                f"not an installed SGLang (run from another directory?): {fix}")
    try:
        importlib.import_module("sglang.srt.server_args")
    except Exception as e:
        return (f"SGLang {version} is installed here ({here}) but does not import "
                f"({type(e).__name__}: {e}): install its dependencies (pip install "
                f"'sglang[all]=={version}') or run verify with the server's python")
    return None


def install_checks() -> list[Check]:
    """Checks 1-4: this interpreter's SGLang and the plugin in it."""
    missing = sglang_missing()
    if missing is not None:
        return [Check("sglang", False, missing)]
    results = [check_version()]
    for fn in (check_loader, check_targets, check_flags):
        try:
            results.append(fn())
        except ImportError as e:
            results.append(Check(fn.__name__.removeprefix("check_"), False,
                                 f"cannot import SGLang here ({e}); run with the server's python"))
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_patch verify",
                                description=__doc__.split("\n")[0])
    add_live_args(p, ENV_DUMP_DIR)
    return p


def main(argv: list[str] | None = None) -> int:
    return verify_main(build_parser(), argv, ENV_DUMP_DIR, install_checks)
