"""ops/ without a farm: preflight's Python and GPU lines, the SGLang and vLLM launchers' help,
dry runs and refusals (real scripts in bash), and deployment files (the env example, compose,
systemd, README, runbook) that agree with the settings table. Where a test needs nvidia-smi it
puts a stand-in on PATH and says so.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from tests.support.ops import OPS, ROOT, clean_env, sh
from worker.core.settings import Settings, _env_name

SETTING_NAMES = {_env_name(f.name) for f in fields(Settings)}


# --- preflight ---------------------------------------------------------------------------------

def test_preflight_outside_the_projects_python_says_which_python_to_use() -> None:
    # Given a python that lacks the farm's libraries (this one, without its site-packages)
    shim = Path(f"/tmp/hsfarm-test-nosite-{os.getpid()}")
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    shim.chmod(0o755)
    try:
        # When preflight runs with it
        res = sh("ops/preflight.sh", env=clean_env(PYTHON=str(shim)))
    finally:
        shim.unlink()
    # Then it says so in two plain lines, no traceback, no word about the server
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout.startswith(f"FAIL  environment: {shim} cannot run the farm's code "
                                 "(ModuleNotFoundError: No module named ")
    assert "PYTHON=/opt/hsfarm/.venv/bin/python ops/preflight.sh" in res.stdout
    assert "Traceback" not in res.stdout + res.stderr and "server" not in res.stdout


def test_preflight_gpu_line_on_this_host() -> None:
    # Given this machine (no NVIDIA GPU)
    if shutil.which("nvidia-smi"):
        pytest.skip("this host has nvidia-smi: the no-GPU line cannot be seen here")
    from producer.preflight import check_gpus
    # When the GPU check runs, Then it says so in one clean line
    line = check_gpus()
    assert str(line) == ("WARN  GPUs: none on this host (no nvidia-smi, no NVIDIA driver): "
                         "nothing to check; SGLang needs the GPUs of the host it runs on (fine "
                         "for the CPU reference server)")


# --- the launcher ------------------------------------------------------------------------------

def test_launcher_help_lists_the_farms_variables() -> None:
    res = sh("ops/launch-sglang.sh", "--help", env=clean_env())
    assert res.returncode == 0 and res.stdout.startswith("Usage: ops/launch-sglang.sh")
    for name in ("FARM_MODEL_PATH", "FARM_DUMP_DIR", "FARM_SERVER_URL", "FARM_LAYERS_TO_CAPTURE",
                 "--dry-run"):
        assert name in res.stdout


@pytest.mark.parametrize("old,new", [("MODEL_PATH", "FARM_MODEL_PATH"),
                                     ("DUMP_DIR", "FARM_DUMP_DIR"),
                                     ("LAYERS", "FARM_LAYERS_TO_CAPTURE"),
                                     ("PORT", "FARM_SERVER_URL")])
def test_launcher_refuses_its_old_variable_names(old: str, new: str) -> None:
    res = sh("ops/launch-sglang.sh", "--dry-run", env=clean_env(**{old: "x"}))
    assert res.returncode == 2
    assert res.stderr.startswith(f"FAIL  {old} is no longer read: set {new} instead")


@pytest.mark.parametrize("verify_rc", [0, 1])
def test_launcher_takes_verifys_verdict_not_its_stderr(tmp_path: Path, tiny_model: Path,
                                                       verify_rc: int) -> None:
    """A library's warning on stderr (torch's pynvml FutureWarning on GPU hosts) is shown, not
    taken for a failure; a verify that fails without a FAIL line still fails. SGLang's python
    is a stand-in here (SGLang is not in this venv): it answers ``-m sglang_patch verify``
    and hands everything else to this python."""
    fake = tmp_path / "python"
    said = 'echo "PASS  sglang version: 0.5.23"' if verify_rc == 0 else "true"
    fake.write_text(
        "#!/bin/bash\n"
        'if [ "$*" = "-m sglang_patch verify" ]; then\n'
        "  echo 'FutureWarning: The pynvml package is deprecated' >&2\n"
        f"  {said}\n"
        f"  exit {verify_rc}\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = clean_env(FARM_MODEL_PATH=str(tiny_model), FARM_DUMP_DIR=str(tmp_path / "d"),
                    FARM_SERVER_URL="http://127.0.0.1:9", SGLANG_TP="1", PYTHON=str(fake))
    out = sh("ops/launch-sglang.sh", "--dry-run", env=env).stdout
    assert "WARN  verify (stderr): FutureWarning: The pynvml package is deprecated" in out, out
    if verify_rc == 0:
        assert "OK    sglang version: 0.5.23" in out and "FAIL  verify" not in out, out
    else:
        assert f"FAIL  verify: {fake} -m sglang_patch verify exited with 1" in out, out


def _verify_passes(tmp_path: Path) -> Path:
    """SGLang's python, stood in (SGLang is not in this venv): its install checks PASS, and
    everything else goes to this python."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\n"
                    'if [ "$*" = "-m sglang_patch verify" ]; then\n'
                    '  echo "PASS  sglang version: 0.5.23"; exit 0\n'
                    "fi\n"
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


def test_launcher_dry_run_with_dp_attention_and_expert_parallelism(tmp_path: Path,
                                                                   tiny_model: Path) -> None:
    # Given Kimi-K2.5's layout on 8 GPUs: DP attention over 8 groups, and EP where asked
    fake = _verify_passes(tmp_path)
    env = clean_env(FARM_MODEL_PATH=str(tiny_model), FARM_DUMP_DIR=str(tmp_path / "d"),
                    FARM_SERVER_URL="http://127.0.0.1:9", SGLANG_TP="8", SGLANG_DP="8",
                    SGLANG_EP="8", PYTHON=str(fake), PATH=_eight_gpus(tmp_path))
    # When the launcher's dry run looks, with an extra SGLang flag for the MoE all-to-all
    res = sh("ops/launch-sglang.sh", "--dry-run", "--", "--moe-a2a-backend", "deepep", env=env)
    # Then the command runs 8 attention-DP groups (SGLang 0.5.23's --attn-dp-size, what
    # --dp-size 8 --enable-dp-attention resolves to) and EP 8, beside the hook's flags
    cmd = res.stdout.splitlines()[-1]
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK    layout: TP 8, 8 attention-DP groups of 1 GPU each, EP 8" in res.stdout
    assert (f"--model-path {tiny_model} --tp-size 8 --attn-dp-size 8 --ep-size 8 --port 9 "
            in cmd), cmd
    assert cmd.endswith("--trust-remote-code --moe-a2a-backend deepep"), cmd
    assert "--disable-radix-cache --disable-prefill-cuda-graph" in cmd
    # And without DP and EP, neither flag appears
    plain = sh("ops/launch-sglang.sh", "--dry-run", env={**env, "SGLANG_DP": "1", "SGLANG_EP": ""})
    assert plain.returncode == 0, plain.stdout
    assert "OK    layout: TP 8 (no DP attention)" in plain.stdout
    assert "--attn-dp-size" not in plain.stdout and "--ep-size" not in plain.stdout
    # And a DP that does not divide TP is refused, with the sizes that do
    bad = sh("ops/launch-sglang.sh", "--dry-run", env={**env, "SGLANG_DP": "3"})
    assert bad.returncode == 1
    assert ("FAIL  SGLANG_DP=3 does not divide SGLANG_TP=8: each attention-DP group takes TP/DP "
            "GPUs; use SGLANG_DP=1, 2, 4 or 8") in bad.stdout, bad.stdout
    # And --help says so
    text = " ".join(sh("ops/launch-sglang.sh", "--help", env=clean_env()).stdout.split())
    assert "SGLANG_DP (attention data-parallel groups" in text
    assert "SGLANG_EP (expert parallel size" in text


def test_launcher_carries_the_store_dtype_to_the_server(tmp_path: Path,
                                                       tiny_model: Path) -> None:
    # Given the farm's settings asking for fp8 storage
    fake = _verify_passes(tmp_path)
    env = clean_env(FARM_MODEL_PATH=str(tiny_model), FARM_DUMP_DIR=str(tmp_path / "d"),
                    FARM_SERVER_URL="http://127.0.0.1:9", SGLANG_TP="1", PYTHON=str(fake),
                    FARM_STORE_DTYPE="fp8_e4m3")
    # When the launcher's dry run looks
    res = sh("ops/launch-sglang.sh", "--dry-run", env=env)
    # Then the server's command stores fp8 too
    assert res.returncode == 0, res.stdout + res.stderr
    cmd = res.stdout.splitlines()[-1]
    assert cmd.startswith(f"SGLANG_HS_DUMP_DIR={tmp_path / 'd'} SGLANG_HS_DUMP_DTYPE=fp8_e4m3 "
                          f"{fake} -m sglang.launch_server "), cmd
    # And bf16 (the default, spelled either way) names no dtype: the hook's default
    for bf16 in ("", "bf16", "bfloat16"):
        plain = sh("ops/launch-sglang.sh", "--dry-run", env={**env, "FARM_STORE_DTYPE": bf16})
        assert plain.returncode == 0 and "SGLANG_HS_DUMP_DTYPE" not in plain.stdout, bf16
    # And a dtype the farm does not know, or a server variable that disagrees, is refused
    bad = sh("ops/launch-sglang.sh", "--dry-run", env={**env, "FARM_STORE_DTYPE": "fp16"})
    assert bad.returncode == 2
    assert "FAIL  FARM_STORE_DTYPE=fp16 must be bf16 or fp8_e4m3" in bad.stderr
    two = sh("ops/launch-sglang.sh", "--dry-run", env={**env, "SGLANG_HS_DUMP_DTYPE": "bfloat16"})
    assert two.returncode == 2
    assert ("SGLANG_HS_DUMP_DTYPE=bfloat16 but FARM_STORE_DTYPE says fp8_e4m3: set "
            "FARM_STORE_DTYPE only") in " ".join(two.stderr.split()), two.stderr
    # And --help and the env file name the setting
    text = " ".join(sh("ops/launch-sglang.sh", "--help", env=clean_env()).stdout.split())
    assert "FARM_STORE_DTYPE bf16 (default) or fp8_e4m3" in text
    assert "SGLANG_HS_DUMP_DTYPE" in text
    assert "FARM_STORE_DTYPE" in (OPS / "systemd" / "env.example").read_text()


def test_launcher_dry_run_without_a_model_dir_or_a_port(tmp_path: Path) -> None:
    env = clean_env(FARM_MODEL_PATH=str(tmp_path / "none"), PYTHON=sys.executable,
                    FARM_SERVER_URL="http://127.0.0.1")
    res = sh("ops/launch-sglang.sh", "--dry-run", env=env)
    assert res.returncode == 2
    assert "FARM_SERVER_URL=http://127.0.0.1 must name a port" in res.stderr
    env["FARM_SERVER_URL"] = "http://127.0.0.1:9"
    res = sh("ops/launch-sglang.sh", "--dry-run", env=env)
    assert res.returncode == 1
    assert f"FAIL  model dir {tmp_path / 'none'} has no config.json" in res.stdout
    assert not (tmp_path / "none").exists()


# --- the vLLM launcher ------------------------------------------------------------------------

SPEC_KIMI = ('\'{"method":"extract_hidden_states","num_speculative_tokens":1,"draft_model_config":'
             '{"hf_config":{"eagle_aux_hidden_state_layer_ids":[2,30,58,61]}}}\'')
KV_CONFIG = '\'{"kv_connector":"HsfarmConnector","kv_role":"kv_producer"}\''
FAKE_SMI = """#!/bin/sh
# a stand-in for nvidia-smi (this machine has no GPU): 8 GPUs, held by the pids in $HOLDERS
case "$1" in
  --query-compute-apps=pid*) for p in $HOLDERS; do printf '%s, x\\n' "$p"; done ;;
  -L) for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: H200"; done ;;
esac
"""


def _eight_gpus(tmp_path: Path) -> str:
    """A PATH whose nvidia-smi lists 8 GPUs (``FAKE_SMI``; none held unless ``HOLDERS``)."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(exist_ok=True)
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    return f"{smi.parent}:{clean_env()['PATH']}"


def _vllm_verify_passes(tmp_path: Path) -> Path:
    """vLLM's python, stood in (vLLM is not in this venv): its install checks PASS, and
    everything else (launch-args, dumpdir, markers) goes to this python."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\n"
                    'if [ "$*" = "-m vllm_hook verify" ]; then\n'
                    '  echo "PASS  vllm version: 0.32.0 (tested: 0.32.x)"; exit 0\n'
                    "fi\n"
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


def _kimi_like(tmp_path: Path) -> Path:
    """A model dir whose config is Kimi-K2.5's shape: 61 layers, in a multimodal wrapper."""
    model = tmp_path / "kimi"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["KimiK25ForConditionalGeneration"],
         "text_config": {"num_hidden_layers": 61, "hidden_size": 7168}}))
    return model


def _vllm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    given = {"FARM_MODEL_PATH": str(_kimi_like(tmp_path)), "FARM_DUMP_DIR": str(tmp_path / "d"),
             "FARM_SERVER_URL": "http://127.0.0.1:9", "PATH": _eight_gpus(tmp_path),
             "HSFARM_NCCL_LOG_DIR": str(tmp_path / "nccl"),
             "PYTHON": str(_vllm_verify_passes(tmp_path))}
    return clean_env(**{**given, **extra})


def _hung_vllm(tmp_path: Path) -> Path:
    """vLLM's python, stood in: its install checks PASS; its API server ignores SIGTERM,
    starts one process titled as vLLM titles its engine core (``VLLM::EngineCore``), which
    exits after 8 s, and then hangs, as vLLM's was seen to after its engine core died."""
    fake = tmp_path / "hung-python"
    fake.write_text("#!/bin/bash\n"
                    'case "$*" in\n'
                    '  "-m vllm_hook verify") echo "PASS  vllm version: 0.32.0"; exit 0 ;;\n'
                    '  "-m vllm.entrypoints.openai.api_server"*)\n'
                    f'    echo $$ > {tmp_path / "server.pid"}\n'
                    "    trap '' TERM\n"
                    "    bash -c 'exec -a VLLM::EngineCore sleep 8' &\n"
                    "    wait\n"
                    "    while :; do sleep 1; done ;;\n"
                    "esac\n"
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


def test_vllm_launcher_stops_a_server_whose_engine_core_died(tmp_path: Path) -> None:
    import contextlib
    import signal
    import socket
    import subprocess

    # Given a vLLM whose engine core dies during start-up and whose API server then hangs,
    # ignoring SIGTERM (stood in: there is no vLLM here)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _vllm_env(tmp_path, VLLM_TP="1", FARM_SERVER_URL=f"http://127.0.0.1:{port}",
                    PYTHON=str(_hung_vllm(tmp_path)))
    # When the launcher starts it
    proc = subprocess.Popen(["bash", str(OPS / "launch-vllm.sh")], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60)
        assert (tmp_path / "server.pid").exists(), out
        server = int((tmp_path / "server.pid").read_text())
        # Then it says why and stops the server's every process, within seconds, and fails
        assert proc.returncode == 1, out
        assert "vLLM: its engine core exited (1 ran, 0 left; its log is above); stopping the " \
               "server and every process of it" in out, out
        assert not Path(f"/proc/{server}").exists() or \
            Path(f"/proc/{server}/stat").read_text().split(") ")[1].startswith("Z")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group, pass or fail
        proc.wait(10)


def test_vllm_launcher_help_lists_the_farms_variables() -> None:
    res = sh("ops/launch-vllm.sh", "--help", env=clean_env())
    assert res.returncode == 0 and res.stdout.startswith("Usage: ops/launch-vllm.sh")
    for name in ("FARM_MODEL_PATH", "FARM_DUMP_DIR", "FARM_SERVER_URL", "FARM_LAYERS_TO_CAPTURE",
                 "FARM_STORE_DTYPE", "FARM_MAX_TOKENS", "HSFARM_VLLM_DUMP_DTYPE", "--dry-run",
                 "Kimi-K2.5 on one 8-GPU host: VLLM_TP=8"):
        assert name in res.stdout, name


def test_vllm_launcher_dry_run_holds_the_connector_the_ids_and_tp_dp(tmp_path: Path) -> None:
    # Given Kimi-K2.5's config (61 layers, in text_config) and the farm's settings
    env = _vllm_env(tmp_path, VLLM_TP="8", FARM_MAX_TOKENS="8192", PATH=_eight_gpus(tmp_path))
    # When the launcher's dry run looks, with an extra vLLM flag
    res = sh("ops/launch-vllm.sh", "--dry-run", "--", "--gpu-memory-utilization", "0.9", env=env)
    # Then every check passes, and the command is vLLM's server with the hook's dump dir,
    # TP 8, a context of FARM_MAX_TOKENS + 1, extract_hidden_states with the default ids and
    # L = 61, and the connector
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK    layout: TP 8 (no data parallelism), --max-model-len 8193" in res.stdout
    assert ("OK    hook layout: aux ids [2, 30, 58] and L = 61 (hidden_state: the final norm "
            "of id 61), HsfarmConnector as kv_producer") in res.stdout, res.stdout
    assert "OK    vllm version: 0.32.0" in res.stdout
    assert res.stdout.splitlines()[-2] == "would run:"
    fake = env["PYTHON"]
    assert res.stdout.splitlines()[-1] == (
        f"HSFARM_VLLM_DUMP_DIR={tmp_path / 'd'} NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH "
        f"NCCL_DEBUG_FILE={tmp_path / 'nccl'}/nccl.%h.%p.log "
        f"{fake} -m vllm.entrypoints.openai.api_server "
        f"--model {tmp_path / 'kimi'} --tensor-parallel-size 8 --max-model-len 8193 "
        f"--host 127.0.0.1 --port 9 --speculative-config {SPEC_KIMI} --kv-transfer-config "
        f"{KV_CONFIG} --trust-remote-code --gpu-memory-utilization 0.9")
    # And the printed command is one a shell runs as it reads
    argv = shlex.split(res.stdout.splitlines()[-1])
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == \
        [2, 30, 58, 61]
    # And data parallelism, the farm's own ids and fp8 storage reach the command
    dp = sh("ops/launch-vllm.sh", "--dry-run", env={
        **env, "VLLM_TP": "2", "VLLM_DP": "4", "FARM_LAYERS_TO_CAPTURE": "3,31,57",
        "FARM_STORE_DTYPE": "fp8_e4m3"})
    assert dp.returncode == 0, dp.stdout
    assert "OK    layout: TP 2 x DP 4: 4 engines of 2 GPUs each, 8 GPUs" in dp.stdout
    cmd = dp.stdout.splitlines()[-1]
    assert cmd.startswith(f"HSFARM_VLLM_DUMP_DIR={tmp_path / 'd'} HSFARM_VLLM_DUMP_DTYPE="
                          "fp8_e4m3 NCCL_DEBUG=INFO "), cmd
    assert "--tensor-parallel-size 2 --data-parallel-size 4 " in cmd
    assert '"eagle_aux_hidden_state_layer_ids":[3,31,57,61]' in cmd
    # And nothing was created
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("extra,args,said,rc", [
    ({"FARM_LAYERS_TO_CAPTURE": "2 30 61"}, (),
     "FAIL  hook layout: aux ids [2, 30, 61]: give three distinct ids below the layer count 61", 1),
    ({"FARM_LAYERS_TO_CAPTURE": "2 30"}, (), "FAIL  FARM_LAYERS_TO_CAPTURE=2 30 must hold 3", 1),
    ({"VLLM_TP": "0"}, (), "FAIL  VLLM_TP=0 must be a positive integer", 1),
    ({"DP": "8"}, (), "FAIL  DP=8 is not read: set VLLM_DP instead", 2),
    ({}, ("--", "--pipeline-parallel-size", "2"), "FAIL  pipeline parallel size 2: the hook "
     "reads the blocks of one stage, and vLLM 0.32 does not carry DeepSeek-V3's or Kimi's", 1),
    ({}, ("--", "-pp=4"), "FAIL  pipeline parallel size 4", 1),
    ({"FARM_STORE_DTYPE": "fp16"}, (), "FAIL  FARM_STORE_DTYPE=fp16 must be bf16 or fp8_e4m3", 2),
    ({"FARM_STORE_DTYPE": "fp8_e4m3", "HSFARM_VLLM_DUMP_DTYPE": "bfloat16"}, (),
     "FAIL  HSFARM_VLLM_DUMP_DTYPE=bfloat16 but FARM_STORE_DTYPE says fp8_e4m3", 2),
    ({"HSFARM_VLLM_DUMP_DIR": "/dev/shm/elsewhere"}, (),
     "FAIL  HSFARM_VLLM_DUMP_DIR=/dev/shm/elsewhere but FARM_DUMP_DIR says", 2),
    ({"DUMP_DIR": "/x"}, (), "FAIL  DUMP_DIR is no longer read: set FARM_DUMP_DIR instead", 2),
    ({"FARM_SERVER_URL": "http://127.0.0.1"}, (), "must name a port", 2),
])
def test_vllm_launcher_refuses_what_the_hook_or_the_farm_cannot_serve(
        tmp_path: Path, extra: dict[str, str], args: tuple[str, ...], said: str,
        rc: int) -> None:
    # Given a setting or a server flag the hook or the farm cannot work with
    env = _vllm_env(tmp_path, **extra)
    # When the launcher's dry run looks
    res = sh("ops/launch-vllm.sh", "--dry-run", *args, env=env)
    # Then it says so with the fix, and fails (2: before any check; 1: a check's FAIL)
    assert res.returncode == rc, res.stdout + res.stderr
    assert " ".join(said.split()) in " ".join((res.stdout + res.stderr).split()), \
        res.stdout + res.stderr
    if rc == 1:
        assert "would run, once the FAILs above are fixed:" in res.stdout


def test_vllm_launcher_refuses_gpus_held_by_another_process_or_too_few(tmp_path: Path) -> None:
    # Given 8 GPUs (a stand-in nvidia-smi: no GPU here), held by this test's process
    env = _vllm_env(tmp_path, PATH=_eight_gpus(tmp_path), VLLM_TP="8")
    # When the launcher's dry run looks
    held = sh("ops/launch-vllm.sh", "--dry-run", env={**env, "HOLDERS": str(os.getpid())})
    free = sh("ops/launch-vllm.sh", "--dry-run", env={**env, "HOLDERS": ""})
    many = sh("ops/launch-vllm.sh", "--dry-run", env={**env, "HOLDERS": "", "VLLM_DP": "8"})
    # Then a holder is named with its unit and the launch refused; free GPUs are OK; and
    # TP x DP over the host's GPUs (SGLang's TP=8 DP=8 read as vLLM's) is refused
    assert held.returncode == 1
    assert f"FAIL  GPUs are in use by: pid {os.getpid()} x (" in held.stdout, held.stdout
    assert free.returncode == 0 and "OK    GPUs: 8 present, none in use" in free.stdout
    assert many.returncode == 1
    assert ("FAIL  VLLM_TP=8 x VLLM_DP=8 (each vLLM data-parallel rank is a whole engine "
            "on TP GPUs) needs 64 GPUs, this host has 8") in many.stdout, many.stdout


# --- deployment files agree with the settings table ----------------------------------------

DEPLOY_FILES = ["README.md", "ops/RUNBOOK.md", "ops/systemd/env.example", "docker-compose.yml",
                *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md"))),
                *(str(p.relative_to(ROOT)) for p in sorted((OPS / "systemd").glob("*.service"))),
                "ops/launch-sglang.sh", "ops/launch-vllm.sh", "ops/launch-common.sh",
                "ops/preflight.sh"]


@pytest.mark.parametrize("name", DEPLOY_FILES)
def test_every_farm_variable_named_is_a_setting(name: str) -> None:
    text = (ROOT / name).read_text()
    named = set(re.findall(r"\bFARM_[A-Z0-9_]+\b", text))
    assert named <= SETTING_NAMES, f"{name} names {sorted(named - SETTING_NAMES)}: not settings"


def test_env_example_sets_settings_and_the_launchers_few_own_names() -> None:
    # launcher, unit and Flower variables that are not settings, each said so in the file
    own = {"REDIS_PASSWORD", "SGLANG_TP", "SGLANG_DP", "VLLM_TP", "VLLM_DP",
           "WORKER_CONCURRENCY", "FLOWER_BASIC_AUTH"}
    text = (OPS / "systemd" / "env.example").read_text()
    names = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", text, re.M))
    assert "FARM_MODEL_PATH" in names and "MODEL_PATH" not in names
    assert names <= SETTING_NAMES | own, sorted(names - SETTING_NAMES - own)
    used = "".join((OPS / "systemd" / u).read_text() for u in os.listdir(OPS / "systemd"))
    used += (OPS / "launch-sglang.sh").read_text() + (OPS / "launch-vllm.sh").read_text()
    used += (OPS / "start-redis.sh").read_text()
    for name in own:  # each is read by a unit or a script
        assert re.search(rf"\b{name}\b", used.replace(text, "")), name


def test_compose_gives_the_server_and_workers_the_same_settings() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    server, worker = services["sglang"]["environment"], services["worker"]["environment"]
    for name in ("FARM_MODEL_PATH", "FARM_DUMP_DIR", "FARM_SERVER_URL",
                 "FARM_LAYERS_TO_CAPTURE"):
        assert server[name] == worker[name], name
    assert not {"MODEL_PATH", "DUMP_DIR", "LAYERS", "PORT"} & set(server)


def test_flower_is_on_loopback_everywhere_and_keeps_its_history() -> None:
    unit = (OPS / "systemd" / "hsfarm-flower.service").read_text()
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["flower"]
    readme = (ROOT / "README.md").read_text()
    started = re.search(r"celery -A worker flower[^\n]*\\\n[^\n]*", readme)
    assert started is not None, "the README starts Flower"
    for where, text in (("unit", unit), ("README", started.group(0))):
        assert "--address=127.0.0.1" in text, where
        for flag in ("--persistent=True", "--db=", "--max_tasks=", "--basic-auth="):
            assert flag in text, (where, flag)
    assert compose["ports"] == ["127.0.0.1:5555:5555"]
    for text in (unit, readme, (ROOT / "docker-compose.yml").read_text()):
        assert "/metrics and /healthcheck" in text.replace("`", "")


def test_readme_and_runbook_say_where_the_logs_are() -> None:
    for doc in ("README.md", "ops/RUNBOOK.md"):
        text = (ROOT / doc).read_text()
        for how in ("journalctl -u hsfarm-worker@1 -f", "docker compose logs -f worker",
                    "tail -f demo-out/logs/demo1.log"):
            assert how in text, (doc, how)


# --- one environment file for either engine ------------------------------------------------


def test_each_launcher_reads_its_own_engines_layout_from_one_env_file(tmp_path: Path,
                                                                      tiny_model: Path) -> None:
    # Given the env file's layout for both engines (Kimi-K2.5: SGLang with 8 attention-DP
    # groups, vLLM as one engine of 8 GPUs) on an 8-GPU host
    values = dict(re.findall(r"^((?:SGLANG|VLLM)_[A-Z]+)=(\S*)$",
                             (OPS / "systemd" / "env.example").read_text(), re.M))
    assert values == {"SGLANG_TP": "8", "SGLANG_DP": "8", "VLLM_TP": "8", "VLLM_DP": "1"}
    path = _eight_gpus(tmp_path)
    sglang = sh("ops/launch-sglang.sh", "--dry-run", env=clean_env(
        FARM_MODEL_PATH=str(tiny_model), FARM_DUMP_DIR=str(tmp_path / "d"), PATH=path,
        FARM_SERVER_URL="http://127.0.0.1:9", PYTHON=str(_verify_passes(tmp_path)), **values))
    vllm = sh("ops/launch-vllm.sh", "--dry-run", env=_vllm_env(tmp_path, PATH=path, **values))
    # When each launcher's dry run reads it, Then SGLang runs DP attention and vLLM one engine
    assert sglang.returncode == 0, sglang.stdout
    assert "OK    layout: TP 8, 8 attention-DP groups of 1 GPU each" in sglang.stdout
    assert vllm.returncode == 0, vllm.stdout
    assert "OK    layout: TP 8 (no data parallelism)" in vllm.stdout
    # And a plain TP/DP/EP (which engine's?) is refused by both, naming the engine's own
    for script, name in (("ops/launch-sglang.sh", "SGLANG_DP"), ("ops/launch-vllm.sh", "VLLM_DP")):
        plain = sh(script, "--dry-run", env=_vllm_env(tmp_path, PATH=path, DP="1"))
        assert plain.returncode == 2, plain.stdout
        assert f"FAIL  DP=1 is not read: set {name} instead" in plain.stderr, plain.stderr


@pytest.mark.parametrize("script,env_layout,said", [
    ("ops/launch-sglang.sh", {"SGLANG_TP": "8"},
     "FAIL  SGLANG_TP=8 needs 8 devices, and this host has no GPU"),
    ("ops/launch-vllm.sh", {"VLLM_TP": "8", "VLLM_DP": "8"},
     "FAIL  VLLM_TP=8 x VLLM_DP=8 (each vLLM data-parallel rank is a whole engine on TP GPUs) "
     "needs 64 devices, and this host has no GPU"),
])
def test_a_launcher_refuses_a_layout_a_gpu_less_host_cannot_hold(
        tmp_path: Path, script: str, env_layout: dict[str, str], said: str) -> None:
    # Given a host with no GPU (no nvidia-smi on PATH) and fewer cores than the layout's ranks
    env = _vllm_env(tmp_path, PATH=clean_env()["PATH"], **env_layout)
    assert shutil.which("nvidia-smi", path=env["PATH"]) is None
    assert (os.cpu_count() or 1) < 8
    # When the dry run looks, Then the layout is a FAIL, not an OK, and nothing starts
    res = sh(script, "--dry-run", env=env)
    assert res.returncode == 1, res.stdout
    assert " ".join(said.split()) in " ".join(res.stdout.split()), res.stdout
    assert "OK    layout" not in res.stdout


def test_vllm_gets_the_farms_max_tokens_and_its_hook_flags_even_in_a_failed_dry_run(
        tmp_path: Path) -> None:
    from worker.core.settings import Settings

    # Given the farm's default FARM_MAX_TOKENS (unset), which the workers read as 8192
    env = _vllm_env(tmp_path, VLLM_TP="8", PATH=_eight_gpus(tmp_path))
    default = re.search(r"^DEFAULT_MAX_TOKENS=(\d+)$",
                        (OPS / "launch-common.sh").read_text(), re.M)
    assert default is not None and int(default.group(1)) == Settings().max_tokens
    # When the dry run looks, Then vLLM gets a context of that + 1, never the model's own
    res = sh("ops/launch-vllm.sh", "--dry-run", env=env)
    assert res.returncode == 0, res.stdout
    assert "--max-model-len 8193" in res.stdout.splitlines()[-1]
    assert "--max-model-len 8193 (FARM_MAX_TOKENS + 1, the farm's default)" in res.stdout
    # And with the model dir missing, or a layout this host cannot hold, the command still
    # shows where the hook's flags go
    gone = sh("ops/launch-vllm.sh", "--dry-run",
              env={**env, "FARM_MODEL_PATH": str(tmp_path / "none")})
    assert gone.returncode == 1
    assert "<hook flags: python -m vllm_hook launch-args" in gone.stdout.splitlines()[-1]
    big = sh("ops/launch-vllm.sh", "--dry-run", env={**env, "VLLM_DP": "8"})
    assert big.returncode == 1 and "--kv-transfer-config" in big.stdout.splitlines()[-1]


def test_the_launchers_pass_nccl_settings_through_and_log_what_nccl_chooses(
        tmp_path: Path, tiny_model: Path) -> None:
    # Given an 8-GPU layout and the NCCL settings of the seed's box in the environment
    tuned = {"NCCL_MAX_NCHANNELS": "32", "NCCL_BUFFSIZE": "8388608"}
    env = _vllm_env(tmp_path, VLLM_TP="8", **tuned)
    # When the dry run looks
    res = sh("ops/launch-vllm.sh", "--dry-run", env=env)
    # Then they are shown, the server is started with NCCL's INFO log of INIT and GRAPH in
    # the log dir, and the settings reach it (the environment passes them)
    assert res.returncode == 0, res.stdout
    assert (f"OK    NCCL settings passed to the server: NCCL_BUFFSIZE=8388608 "
            f"NCCL_MAX_NCHANNELS=32; its INFO log (INIT, GRAPH) in {tmp_path / 'nccl'}"
            in res.stdout), res.stdout
    assert (f"NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH NCCL_DEBUG_FILE="
            f"{tmp_path / 'nccl'}/nccl.%h.%p.log" in res.stdout.splitlines()[-1])
    # And an operator's own NCCL_DEBUG is kept; one GPU has no collectives to log
    own = sh("ops/launch-vllm.sh", "--dry-run", env={**env, "NCCL_DEBUG": "WARN"})
    assert "NCCL_DEBUG=WARN NCCL_DEBUG_SUBSYS=INIT,GRAPH" in own.stdout.splitlines()[-1]
    one = sh("ops/launch-sglang.sh", "--dry-run", env=clean_env(
        FARM_MODEL_PATH=str(tiny_model), FARM_DUMP_DIR=str(tmp_path / "d"), SGLANG_TP="1",
        FARM_SERVER_URL="http://127.0.0.1:9", PYTHON=str(_verify_passes(tmp_path))))
    assert "OK    NCCL: one GPU, no collectives" in one.stdout
    assert "NCCL_DEBUG" not in one.stdout.splitlines()[-1]
