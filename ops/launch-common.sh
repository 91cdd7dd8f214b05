# Sourced by ops/launch-sglang.sh and ops/launch-vllm.sh (not run on its own): what both
# launchers do the same way, for the engine the sourcing script names before it calls these:
#   ENGINE (SGLang or vLLM, in messages), HOOK (its hook's python module: sglang_patch or
#   vllm_hook), DUMP_DIR_VAR and DUMP_DTYPE_VAR (the variables its hook reads), HEALTH_PATH
#   (the server's readiness path) and dry_run (1 for --dry-run).
# farm_settings reads the farm's variables into MODEL, DUMP_DIR, URL, PORT, PY, DUMP_DTYPE and
# layers (exit 2 on a bad one); the check_* functions print one OK/WARN/FAIL line each and set
# failed=1 on a FAIL; wait_ready starts the server and waits for a correct probe dump, then
# watches it (engine_check, where the launcher defines one).

# parse_options "$@": --help (the script's header), --dry-run (sets dry_run=1); the rest,
# after an optional "--", are the server's own args: rest=(...)
parse_options() {
  dry_run=0
  while [ $# -gt 0 ]; do
    case "$1" in
      -h|--help) usage; exit 0 ;;
      --dry-run) dry_run=1; shift ;;
      --) shift; break ;;
      *) break ;;
    esac
  done
  rest=("$@")
}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

# The farm's default FARM_MAX_TOKENS (worker/core/settings.py; tests/unit/test_ops.py keeps the
# two equal): what the workers read when FARM_MAX_TOKENS is unset, so the server's context too.
DEFAULT_MAX_TOKENS=8192

failed=0
ok()   { echo "OK    $*"; }
warn() { echo "WARN  $*"; }
bad()  { echo "FAIL  $*"; failed=1; }

farm_settings() {
  # The launchers' old variable names: refused, so that the server and the workers can never
  # read two different values of one setting.
  local pair old
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
  PY=${PYTHON:-python3}
  case "${FARM_STORE_DTYPE:-bf16}" in
    bf16|bfloat16) DUMP_DTYPE=bfloat16 ;;
    fp8_e4m3) DUMP_DTYPE=fp8_e4m3 ;;
    *) echo "FAIL  FARM_STORE_DTYPE=$FARM_STORE_DTYPE must be bf16 or fp8_e4m3" >&2; exit 2 ;;
  esac
  if [ -n "${!DUMP_DTYPE_VAR:-}" ] && [ "${!DUMP_DTYPE_VAR}" != "$DUMP_DTYPE" ]; then
    echo "FAIL  $DUMP_DTYPE_VAR=${!DUMP_DTYPE_VAR} but FARM_STORE_DTYPE says" \
         "$DUMP_DTYPE: set FARM_STORE_DTYPE only (the workers read it too), and unset" \
         "$DUMP_DTYPE_VAR" >&2
    exit 2
  fi
  LAYERS_RAW=${FARM_LAYERS_TO_CAPTURE:-}
  read -r -a layers <<<"${LAYERS_RAW//,/ }"
}

# layout_settings PREFIX (SGLANG or VLLM): the launcher's TP, DP and EP from PREFIX_TP,
# PREFIX_DP and PREFIX_EP (their names in TPV, DPV, EPV, for messages). One env file serves both
# launchers, and DP means two things: SGLang's attention-DP groups share one engine of TP GPUs,
# vLLM's DP ranks are whole engines of TP GPUs each. Plain TP, DP and EP are refused: nothing
# could tell which engine they were meant for.
layout_settings() {
  local v
  for v in TP DP EP; do
    if [ -n "${!v:-}" ]; then
      echo "FAIL  $v=${!v} is not read: set ${1}_$v instead (each engine has its own layout" \
           "variables in /etc/hsfarm/env: SGLANG_TP, SGLANG_DP, SGLANG_EP for SGLang;" \
           "VLLM_TP, VLLM_DP for vLLM)" >&2
      exit 2
    fi
  done
  TPV=${1}_TP DPV=${1}_DP EPV=${1}_EP
  TP=${!TPV:-8}
  DP=${!DPV:-1}
  EP=${!EPV:-}
}

# check_devices N WHAT: FAIL (and return 1) when this host cannot hold WHAT, a layout of N
# devices: more than its GPUs or, with no GPU (a CPU engine: a rank per core at least), more
# than its cores.
check_devices() {
  local gpus=0 cores
  if command -v nvidia-smi >/dev/null; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  if [ "$gpus" -gt 0 ]; then
    [ "$1" -gt "$gpus" ] || return 0
    bad "$2 needs $1 GPUs, this host has $gpus"
    return 1
  fi
  cores=$(nproc)
  [ "$1" -gt "$cores" ] || return 0
  bad "$2 needs $1 devices, and this host has no GPU (no nvidia-smi, or it lists none) and" \
      "$cores CPU cores: run it on the GPU host"
  return 1
}

# nccl_setup: the server's NCCL logs go to NCCL_LOG_DIR (HSFARM_NCCL_LOG_DIR, else
# /var/log/hsfarm/nccl-PORT where this user may write, else the temp dir; engine_dump/nccl.py's
# log_dirs, which preflight reads), at INFO for INIT and GRAPH unless the operator set
# NCCL_DEBUG*; the NCCL_* settings given are passed through, shown in one line.
nccl_setup() {
  nccl_env=()
  NCCL_LOG_DIR=
  if [ $((TP * DP)) -le 1 ]; then ok "NCCL: one GPU, no collectives"; return 0; fi
  if [ -n "${HSFARM_NCCL_LOG_DIR:-}" ]; then NCCL_LOG_DIR=$HSFARM_NCCL_LOG_DIR
  elif [ -w /var/log/hsfarm ] || { [ ! -e /var/log/hsfarm ] && [ -w /var/log ]; }; then
    NCCL_LOG_DIR=/var/log/hsfarm/nccl-$PORT
  else NCCL_LOG_DIR=${TMPDIR:-/tmp}/hsfarm-nccl-$PORT
  fi
  nccl_env=("NCCL_DEBUG=${NCCL_DEBUG:-INFO}" "NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT,GRAPH}"
            "NCCL_DEBUG_FILE=${NCCL_DEBUG_FILE:-$NCCL_LOG_DIR/nccl.%h.%p.log}")
  local given
  given=$(env | grep -E '^NCCL_' | grep -vE '^NCCL_DEBUG(_SUBSYS|_FILE)?=' | sort \
          | tr '\n' ' ' || true)
  [ -n "$given" ] || given="none, the defaults of NCCL "
  ok "NCCL settings passed to the server: ${given% }; its INFO log (INIT, GRAPH) in" \
     "$NCCL_LOG_DIR"
}

# check_nccl: after the server is ready, what NCCL chose (a WARN with the fix on the slow ring)
check_nccl() {
  [ -z "$NCCL_LOG_DIR" ] || "$PY" -m "$HOOK" nccl --log-dir "$NCCL_LOG_DIR" || true
}

check_model_dir() {
  if [ -f "$MODEL/config.json" ]; then ok "model dir $MODEL"
  else bad "model dir $MODEL has no config.json: set FARM_MODEL_PATH to the local model directory"
  fi
  if [ "${#layers[@]}" -ne 0 ] && { [ "${#layers[@]}" -ne 3 ] \
       || ! [[ "${layers[*]}" =~ ^[0-9]+\ [0-9]+\ [0-9]+$ ]]; }; then
    bad "FARM_LAYERS_TO_CAPTURE=$LAYERS_RAW must hold 3 layer ids"
  fi
}

check_install() {
  if ! command -v "$PY" >/dev/null; then
    bad "PYTHON=$PY is not a command: set PYTHON to $ENGINE's python"; return
  fi
  # verify's verdict is its stdout (PASS/FAIL lines) and its exit code; what a library
  # prints on stderr (a FutureWarning at import, say) is shown, not taken for a failure
  local out err rc=0 said_fail=0
  err=$(mktemp)
  out=$("$PY" -m "$HOOK" verify 2>"$err") || rc=$?
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
    bad "verify: $PY -m $HOOK verify exited with $rc (its output above)"
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
    warn "GPUs: none on this host (no nvidia-smi, no NVIDIA driver): $ENGINE will fail to" \
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

check_port() {  # $1: a path that says what answers there
  if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
    local what
    what=$(curl -s -m 3 "http://127.0.0.1:$PORT$1" 2>/dev/null || true)
    bad "port $PORT: something already listens there${what:+ ($1: ${what:0:120})}:" \
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
  if owner=$("$PY" -m "$HOOK" dumpdir --dump-dir "$DUMP_DIR" 2>&1); then
    ok "${owner#OK    }"
  else
    bad "${owner#FAIL  }"; return 0
  fi
  [ -d "$DUMP_DIR" ] || return 0
  local mode=() dead
  [ "$dry_run" = 1 ] || mode=(--remove-dead)
  if dead=$("$PY" -m "$HOOK" markers --dump-dir "$DUMP_DIR" "${mode[@]}" 2>&1); then
    ok "ready markers: $(tail -n 1 <<<"$dead")$([ "$dry_run" = 1 ] && echo \
       ' (the dead ones are removed at start)')"
  fi
}

# Starts "$@" with server_env, waits for HEALTH_PATH and a fresh ready marker of the new
# server, then for one probe request of ours to come back as a correct dump; "ready". Then
# watches it until it exits: a launcher that defines engine_check PID (which sets engine_why
# when the server can no longer serve, e.g. vLLM's engine core died and its API server went
# on, hung) stops the server's whole process tree with the reason, at start-up or later.
wait_ready() {
  local out started
  # created 0700 (the server's alone), or refused when another user made it first
  if ! out=$("$PY" -m "$HOOK" dumpdir --create --dump-dir "$DUMP_DIR"); then
    echo "$out"; echo "not starting $ENGINE: fix the dump dir"; exit 1
  fi
  if [ -n "$NCCL_LOG_DIR" ]; then  # this start's logs only
    mkdir -p "$NCCL_LOG_DIR" && rm -f "$NCCL_LOG_DIR"/nccl.*.log
  fi
  started=$(date +%s)
  env "${server_env[@]}" "$@" &
  server=$!
  trap 'stop_tree "$server"; exit 143' INT TERM
  for _ in $(seq 1 720); do
    if ! kill -0 "$server" 2>/dev/null; then echo "$ENGINE exited during start-up"; exit 1; fi
    broken "$server" && exit 1
    if curl -sf "http://127.0.0.1:$PORT$HEALTH_PATH" >/dev/null \
       && "$PY" -m "$HOOK" verify --live-only --dump-dir "$DUMP_DIR" --since "$started" \
          >/dev/null 2>&1; then
      # the hook is up: one probe request of ours must now come back as a correct dump
      if ! "$PY" -m "$HOOK" verify --live-only --dump-dir "$DUMP_DIR" --since "$started" \
           --server "http://127.0.0.1:$PORT" --timeout-s 600; then
        echo "the server runs but its dumps are wrong (above); stopping it"
        stop_tree "$server"; exit 1
      fi
      check_nccl
      echo ready
      while kill -0 "$server" 2>/dev/null; do
        broken "$server" && exit 1
        sleep 5
      done
      wait "$server"
      exit $?
    fi
    sleep 5
  done
  echo "$ENGINE did not become ready in 1 hour"; stop_tree "$server"; exit 1
}

# broken PID: true (the reason said, every process of the server killed) when the launcher's
# engine_check finds the server can no longer serve
broken() {
  engine_why=""
  if declare -F engine_check >/dev/null; then engine_check "$1"; fi
  [ -n "$engine_why" ] || return 1
  echo "$ENGINE: $engine_why; stopping the server and every process of it"
  kill_tree KILL "$1"
}

# descendants PID: the pids of every process below PID (children, theirs, ...)
descendants() {
  ps -e -o pid= -o ppid= | awk -v root="$1" '
    { kids[$2] = kids[$2] " " $1 }
    END { n = split(kids[root], q, " ")
          for (i = 1; i <= n; i++) { m = split(kids[q[i]], r, " ")
                                     for (j = 1; j <= m; j++) q[++n] = r[j] }
          for (i = 1; i <= n; i++) print q[i] }'
}

# kill_tree SIGNAL PID: SIGNAL to PID and every process below it (listed first: none escapes)
kill_tree() {
  local p pids
  pids=$(descendants "$2")
  for p in "$2" $pids; do kill "-$1" "$p" 2>/dev/null || true; done
  [ "$1" != KILL ] || wait "$2" 2>/dev/null || true
}

# stop_tree PID: SIGTERM to the server's processes, SIGKILL to what is left after 30 s
stop_tree() {
  kill_tree TERM "$1"
  for _ in $(seq 1 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill_tree KILL "$1"
}

quote() {  # a word as a person would type it: bare when safe, else in single quotes
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@+%-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

print_dry_run() {  # the server's environment and "$@", as a shell would run them
  if [ "$failed" = 0 ]; then echo "would run:"; else echo "would run, once the FAILs above are fixed:"; fi
  local first=1 kv
  for kv in "${server_env[@]}"; do
    [ "$first" = 1 ] || printf ' '
    printf '%s=%s' "${kv%%=*}" "$(quote "${kv#*=}")"
    first=0
  done
  local word
  for word in "$@"; do printf ' %s' "$(quote "$word")"; done
  echo
  exit "$failed"
}
