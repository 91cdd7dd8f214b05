#!/usr/bin/env bash
# Usage: ops/launch-sglang.sh [--dry-run] [--help] [-- extra sglang.launch_server args]
# Starts SGLang with the hsfarm dump hook, reading the same variables as the farm's settings
# (/etc/hsfarm/env; python -m producer settings):
#   FARM_MODEL_PATH         the local model directory (required)
#   FARM_DUMP_DIR           the hook's dump dir, the workers' too (default /dev/shm/hsfarm-dumps)
#   FARM_SERVER_URL         the port to listen on is taken from it (default http://127.0.0.1:30000)
#   FARM_LAYERS_TO_CAPTURE  three aux layer ids, e.g. "2 30 58" (default: SGLang's own)
#   FARM_STORE_DTYPE        bf16 (default) or fp8_e4m3: the hook stores that, as the workers
#                           expect (passed to the server as SGLANG_HS_DUMP_DTYPE)
# and, for the launcher only: SGLANG_TP (tensor parallel size, default 8), SGLANG_DP (attention
# data-parallel groups, default 1: with SGLANG_DP > 1, --attn-dp-size, SGLang 0.5.23's spelling
# of --dp-size --enable-dp-attention; it must divide SGLANG_TP: each group's attention runs on
# TP/DP GPUs, with its own scheduler and its own dump writer), SGLANG_EP (expert parallel size,
# default unset: --ep-size; other MoE flags such as --moe-a2a-backend go after --); plain TP,
# DP and EP are refused (vLLM's DP means whole engines), SGLANG_HOST (address to bind,
# default 127.0.0.1; 0.0.0.0 only inside a container network), PYTHON (SGLang's python,
# default python3).
# Checks first, one line each (OK, WARN or FAIL): the model dir, the layout (refused when the
# host has fewer GPUs than SGLANG_TP), the install (python -m
# sglang_patch verify: SGLang, its plugin loader, hook targets, flags), the GPUs (refuses while
# another process holds them, naming it and its systemd unit), the port, the dump dir (tmpfs;
# its owner and mode: refused when another user owns it or others can write to it; ready
# markers of dead servers: removed; created 0700 when missing). Then starts SGLang with SGLANG_HS_DUMP_DIR and the
# flags extraction needs, waits for a fresh ready marker of the new server and one probe
# request of ours to come back as a correct dump (python -m sglang_patch verify --live-only),
# and prints "ready". --dry-run: all the checks, then the exact command, starting nothing
# and removing nothing; exit 0 only when no check failed.
# When right it ends with "PASS  ready marker: pid ... (alive), ... layers [2, 30, 58] ...",
# "PASS  probe request: a 16-token request of ours through ... all finite" and "ready".
set -euo pipefail
ENGINE=SGLang HOOK=sglang_patch HEALTH_PATH=/model_info
DUMP_DIR_VAR=SGLANG_HS_DUMP_DIR DUMP_DTYPE_VAR=SGLANG_HS_DUMP_DTYPE
. "$(dirname "${BASH_SOURCE[0]}")/launch-common.sh"
parse_options "$@"
set -- ${rest[@]+"${rest[@]}"}

farm_settings
layout_settings SGLANG
HOST=${SGLANG_HOST:-127.0.0.1}

check_model() {
  check_model_dir
  if ! [[ "$TP" =~ ^[1-9][0-9]*$ ]]; then bad "$TPV=$TP must be a positive integer"; return; fi
  if ! [[ "$DP" =~ ^[1-9][0-9]*$ ]]; then bad "$DPV=$DP must be a positive integer"; return; fi
  if [ -n "$EP" ] && ! [[ "$EP" =~ ^[1-9][0-9]*$ ]]; then
    bad "$EPV=$EP must be a positive integer (or unset)"; return
  fi
  if [ $((TP % DP)) -ne 0 ]; then
    local d fits=()
    for ((d = 1; d <= TP; d++)); do [ $((TP % d)) -ne 0 ] || fits+=("$d"); done
    local last=${fits[-1]}
    unset 'fits[-1]'
    local list="${fits[*]}"
    bad "$DPV=$DP does not divide $TPV=$TP: each attention-DP group takes TP/DP GPUs; use" \
        "$DPV=${list// /, }${list:+ or }$last"
    return
  fi
  check_devices "$TP" "$TPV=$TP" || return 0
  local layout="TP $TP (no DP attention)"
  [ "$DP" -eq 1 ] || layout="TP $TP, $DP attention-DP groups of $((TP / DP)) GPU$(
    [ $((TP / DP)) -eq 1 ] || echo s) each"
  ok "layout: $layout${EP:+, EP $EP}"
}

check_model
check_install
check_gpus
check_port /model_info
check_dump_dir
nccl_setup

layer_args=()
[ "${#layers[@]}" -eq 0 ] || layer_args=(--return-aux-hidden-state-layer-ids "${layers[@]}")
parallel=(--tp-size "$TP")
[ "$DP" = 1 ] || parallel+=(--attn-dp-size "$DP")
[ -z "$EP" ] || parallel+=(--ep-size "$EP")
# the hook's default is bf16: its variable is named only when it says something else
server_env=("SGLANG_HS_DUMP_DIR=$DUMP_DIR")
[ "$DUMP_DTYPE" = bfloat16 ] || server_env+=("SGLANG_HS_DUMP_DTYPE=$DUMP_DTYPE")
server_env+=(${nccl_env[@]+"${nccl_env[@]}"})
cmd=("$PY" -m sglang.launch_server --model-path "$MODEL" "${parallel[@]}" --port "$PORT"
     --host "$HOST" --disable-radix-cache --disable-prefill-cuda-graph --skip-server-warmup
     --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "${layer_args[@]}"
     --trust-remote-code "$@")

[ "$dry_run" = 0 ] || print_dry_run "${cmd[@]}"
if [ "$failed" != 0 ]; then echo "not starting SGLang: fix the FAIL lines above"; exit 1; fi
wait_ready "${cmd[@]}"
