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
# and, for the launcher only: TP (tensor parallel size, default 8), DP (attention data-parallel
# groups, default 1: with DP > 1, --attn-dp-size DP, SGLang 0.5.23's spelling of --dp-size DP
# --enable-dp-attention; it must divide TP: each group's attention runs on TP/DP GPUs, with its
# own scheduler and its own dump writer), EP (expert parallel size, default unset: --ep-size
# EP; other MoE flags such as --moe-a2a-backend go after --), SGLANG_HOST (address to bind,
# default 127.0.0.1; 0.0.0.0 only inside a container network), PYTHON (SGLang's python,
# default python3).
# Checks first, one line each (OK, WARN or FAIL): the model dir, the install (python -m
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

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done

# The launcher's old variable names: refused, so that the server and the workers can never read
# two different values of one setting.
for pair in MODEL_PATH:FARM_MODEL_PATH DUMP_DIR:FARM_DUMP_DIR LAYERS:FARM_LAYERS_TO_CAPTURE \
            PORT:FARM_SERVER_URL; do
  old=${pair%%:*}
  if [ -n "${!old:-}" ]; then
    echo "FAIL  $old is no longer read: set ${pair##*:} instead (in /etc/hsfarm/env: the" \
         "workers and python -m producer read that name too)" >&2
    exit 2
  fi
done
if [ -z "${FARM_MODEL_PATH:-}" ]; then
  echo "FAIL  FARM_MODEL_PATH is not set: the local model directory (see --help)" >&2
  exit 2
fi
MODEL=$FARM_MODEL_PATH
DUMP_DIR=${FARM_DUMP_DIR:-/dev/shm/hsfarm-dumps}
URL=${FARM_SERVER_URL:-http://127.0.0.1:30000}
if [[ ! "$URL" =~ ^https?://[^/:]+:([0-9]+)/?$ ]]; then
  echo "FAIL  FARM_SERVER_URL=$URL must name a port, like http://127.0.0.1:30000" >&2
  exit 2
fi
PORT=${BASH_REMATCH[1]}
TP=${TP:-8}
DP=${DP:-1}
EP=${EP:-}
HOST=${SGLANG_HOST:-127.0.0.1}
PY=${PYTHON:-python3}
case "${FARM_STORE_DTYPE:-bf16}" in
  bf16|bfloat16) DUMP_DTYPE=bfloat16 ;;
  fp8_e4m3) DUMP_DTYPE=fp8_e4m3 ;;
  *) echo "FAIL  FARM_STORE_DTYPE=$FARM_STORE_DTYPE must be bf16 or fp8_e4m3" >&2; exit 2 ;;
esac
if [ -n "${SGLANG_HS_DUMP_DTYPE:-}" ] && [ "$SGLANG_HS_DUMP_DTYPE" != "$DUMP_DTYPE" ]; then
  echo "FAIL  SGLANG_HS_DUMP_DTYPE=$SGLANG_HS_DUMP_DTYPE but FARM_STORE_DTYPE says" \
       "$DUMP_DTYPE: set FARM_STORE_DTYPE only (the workers read it too), and unset" \
       "SGLANG_HS_DUMP_DTYPE" >&2
  exit 2
fi
LAYERS_RAW=${FARM_LAYERS_TO_CAPTURE:-}
read -r -a layers <<<"${LAYERS_RAW//,/ }"

failed=0
ok()   { echo "OK    $*"; }
warn() { echo "WARN  $*"; }
bad()  { echo "FAIL  $*"; failed=1; }

check_model() {
  if [ -f "$MODEL/config.json" ]; then ok "model dir $MODEL"
  else bad "model dir $MODEL has no config.json: set FARM_MODEL_PATH to the local model directory"
  fi
  if [ "${#layers[@]}" -ne 0 ] && { [ "${#layers[@]}" -ne 3 ] \
       || ! [[ "${layers[*]}" =~ ^[0-9]+\ [0-9]+\ [0-9]+$ ]]; }; then
    bad "FARM_LAYERS_TO_CAPTURE=$LAYERS_RAW must hold 3 layer ids"
  fi
  if ! [[ "$TP" =~ ^[1-9][0-9]*$ ]]; then bad "TP=$TP must be a positive integer"; return; fi
  if ! [[ "$DP" =~ ^[1-9][0-9]*$ ]]; then bad "DP=$DP must be a positive integer"; return; fi
  if [ -n "$EP" ] && ! [[ "$EP" =~ ^[1-9][0-9]*$ ]]; then
    bad "EP=$EP must be a positive integer (or unset)"; return
  fi
  if [ $((TP % DP)) -ne 0 ]; then
    local d fits=()
    for ((d = 1; d <= TP; d++)); do [ $((TP % d)) -ne 0 ] || fits+=("$d"); done
    local last=${fits[-1]}
    unset 'fits[-1]'
    local list="${fits[*]}"
    bad "DP=$DP does not divide TP=$TP: each attention-DP group takes TP/DP GPUs; use" \
        "DP=${list// /, }${list:+ or }$last"
    return
  fi
  local layout="TP $TP (no DP attention)"
  [ "$DP" -eq 1 ] || layout="TP $TP, $DP attention-DP groups of $((TP / DP)) GPU$(
    [ $((TP / DP)) -eq 1 ] || echo s) each"
  ok "layout: $layout${EP:+, EP $EP}"
}

check_install() {
  if ! command -v "$PY" >/dev/null; then
    bad "PYTHON=$PY is not a command: set PYTHON to SGLang's python"; return
  fi
  # verify's verdict is its stdout (PASS/FAIL lines) and its exit code; what a library
  # prints on stderr (a FutureWarning at import, say) is shown, not taken for a failure
  local out err rc=0 said_fail=0
  err=$(mktemp)
  out=$("$PY" -m sglang_patch verify 2>"$err") || rc=$?
  while IFS= read -r line; do
    case "$line" in
      "PASS  "*) ok "${line#PASS  }" ;;
      "FAIL  "*) bad "${line#FAIL  }"; said_fail=1 ;;
      "") ;;
      *) warn "verify: $line" ;;
    esac
  done <<<"$out"
  while IFS= read -r line; do
    if [ -n "$line" ]; then warn "verify (stderr): $line"; fi
  done <"$err"
  rm -f "$err"
  if [ "$rc" -ne 0 ] && [ "$said_fail" -eq 0 ]; then
    bad "verify: $PY -m sglang_patch verify exited with $rc (its output above)"
  fi
}

unit_of() {  # the systemd unit (or container scope) of a pid, from its cgroup
  local unit
  unit=$( (tr ':/' '\n' <"/proc/$1/cgroup" | grep -E '\.(service|scope)$' | tail -n 1) \
         2>/dev/null || true)
  echo "${unit:-no systemd unit}"
}

check_gpus() {
  if ! command -v nvidia-smi >/dev/null; then
    warn "GPUs: none on this host (no nvidia-smi, no NVIDIA driver): SGLang will fail to" \
         "start unless it runs on CPU"
    return
  fi
  local apps pid name held=""
  if ! apps=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>&1); then
    bad "GPUs: nvidia-smi failed ($apps): is the driver loaded?"; return
  fi
  while IFS=', ' read -r pid name; do
    [ -n "$pid" ] || continue
    held+="${held:+; }pid $pid $name ($(unit_of "$pid"))"
  done <<<"$apps"
  if [ -z "$held" ]; then ok "GPUs: $(nvidia-smi -L | wc -l) present, none in use"
  else bad "GPUs are in use by: $held: stop them first (systemctl disable --now UNIT;" \
           "see ops/RUNBOOK.md, 'GPUs held')"
  fi
}

check_port() {
  if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
    local what
    what=$(curl -s -m 3 "http://127.0.0.1:$PORT/model_info" 2>/dev/null || true)
    bad "port $PORT: something already listens there${what:+ (/model_info: ${what:0:120})}:" \
        "another server? stop it, or set FARM_SERVER_URL to another port"
  else ok "port $PORT is free"
  fi
  command -v curl >/dev/null || bad "curl is not installed: the readiness wait needs it"
}

check_dump_dir() {
  local at=$DUMP_DIR kind
  while [ ! -e "$at" ] && [ "$at" != / ]; do at=$(dirname "$at"); done
  kind=$(stat -f -c %T "$at" 2>/dev/null || echo "?")
  case "$kind" in
    tmpfs|ramfs) ok "dump dir $DUMP_DIR is on $kind${at:+ ($at)}" ;;
    *) warn "dump dir $DUMP_DIR is on $kind, not tmpfs: every dump would hit a disk twice" \
            "(use a directory under /dev/shm)" ;;
  esac
  local owner
  if owner=$("$PY" -m sglang_patch dumpdir --dump-dir "$DUMP_DIR" 2>&1); then
    ok "${owner#OK    }"
  else
    bad "${owner#FAIL  }"; return 0
  fi
  [ -d "$DUMP_DIR" ] || return 0
  local mode=() dead
  [ "$dry_run" = 1 ] || mode=(--remove-dead)
  if dead=$("$PY" -m sglang_patch markers --dump-dir "$DUMP_DIR" "${mode[@]}" 2>&1); then
    ok "ready markers: $(tail -n 1 <<<"$dead")$([ "$dry_run" = 1 ] && echo \
       ' (the dead ones are removed at start)')"
  fi
}

check_model
check_install
check_gpus
check_port
check_dump_dir

layer_args=()
[ "${#layers[@]}" -eq 0 ] || layer_args=(--return-aux-hidden-state-layer-ids "${layers[@]}")
parallel=(--tp-size "$TP")
[ "$DP" = 1 ] || parallel+=(--attn-dp-size "$DP")
[ -z "$EP" ] || parallel+=(--ep-size "$EP")
# the hook's default is bf16: its variable is named only when it says something else
server_env=("SGLANG_HS_DUMP_DIR=$DUMP_DIR")
[ "$DUMP_DTYPE" = bfloat16 ] || server_env+=("SGLANG_HS_DUMP_DTYPE=$DUMP_DTYPE")
cmd=("$PY" -m sglang.launch_server --model-path "$MODEL" "${parallel[@]}" --port "$PORT"
     --host "$HOST" --disable-radix-cache --disable-prefill-cuda-graph --skip-server-warmup
     --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "${layer_args[@]}"
     --trust-remote-code "$@")

if [ "$dry_run" = 1 ]; then
  if [ "$failed" = 0 ]; then echo "would run:"; else echo "would run, once the FAILs above are fixed:"; fi
  printf 'SGLANG_HS_DUMP_DIR=%q' "$DUMP_DIR"
  [ "${#server_env[@]}" -eq 1 ] || printf ' SGLANG_HS_DUMP_DTYPE=%q' "$DUMP_DTYPE"
  printf ' %q' "${cmd[@]}"; echo
  exit "$failed"
fi
if [ "$failed" != 0 ]; then echo "not starting SGLang: fix the FAIL lines above"; exit 1; fi

# created 0700 (the server's alone), or refused when another user made it first
if ! out=$("$PY" -m sglang_patch dumpdir --create --dump-dir "$DUMP_DIR"); then
  echo "$out"; echo "not starting SGLang: fix the dump dir"; exit 1
fi
started=$(date +%s)
env "${server_env[@]}" "${cmd[@]}" &
server=$!
trap 'kill $server 2>/dev/null || true' INT TERM
for _ in $(seq 1 720); do
  if ! kill -0 "$server" 2>/dev/null; then echo "SGLang exited during start-up"; exit 1; fi
  if curl -sf "http://127.0.0.1:$PORT/model_info" >/dev/null \
     && "$PY" -m sglang_patch verify --live-only --dump-dir "$DUMP_DIR" --since "$started" \
        >/dev/null 2>&1; then
    # the hook is up: one probe request of ours must now come back as a correct dump
    if ! "$PY" -m sglang_patch verify --live-only --dump-dir "$DUMP_DIR" --since "$started" \
         --server "http://127.0.0.1:$PORT" --timeout-s 600; then
      echo "the server runs but its dumps are wrong (above); stopping it"
      kill "$server"; wait "$server" || true; exit 1
    fi
    echo ready
    wait "$server"
    exit $?
  fi
  sleep 5
done
echo "SGLang did not become ready in 1 hour"; exit 1
