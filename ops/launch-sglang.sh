#!/usr/bin/env bash
# Usage: MODEL_PATH=/models/Kimi-K2.5 [TP=8] [DUMP_DIR=/dev/shm/hsfarm-dumps] [PORT=30000] \
#          [LAYERS="1 29 57"] ops/launch-sglang.sh [extra sglang args]
# Checks the install (python -m sglang_patch verify), refuses to start while something else
# holds the GPUs, starts SGLang with the dump hook and the flags extraction needs, and waits
# until the hook has written a fresh ready marker and a probe request of ours came back as a
# correct dump (python -m sglang_patch verify --live-only --server URL --dump-dir DIR).
# When right it ends with "PASS  ready marker: pid ... layers [2, 30, 58] ...",
# "PASS  probe request: a 16-token request of ours through ... all finite" and "ready".
set -euo pipefail
: "${MODEL_PATH:?set MODEL_PATH to the local model directory}"
TP=${TP:-8}
PORT=${PORT:-30000}
DUMP_DIR=${DUMP_DIR:-/dev/shm/hsfarm-dumps}
PY=${PYTHON:-python3}

"$PY" -m sglang_patch verify
if command -v nvidia-smi >/dev/null; then
  busy=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader || true)
  if [ -n "$busy" ]; then
    echo "GPUs are in use by:"; echo "$busy"
    echo "stop them first (an auto-started inference service?): see ops/RUNBOOK.md, 'GPUs held'"
    exit 1
  fi
fi
mkdir -p "$DUMP_DIR"
rm -f "$DUMP_DIR"/.ready.*
layer_args=()
[ -n "${LAYERS:-}" ] && layer_args=(--return-aux-hidden-state-layer-ids $LAYERS)
SGLANG_HS_DUMP_DIR="$DUMP_DIR" "$PY" -m sglang.launch_server \
  --model-path "$MODEL_PATH" --tp-size "$TP" --port "$PORT" --host 127.0.0.1 \
  --disable-radix-cache --disable-prefill-cuda-graph --skip-server-warmup \
  --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "${layer_args[@]}" \
  --trust-remote-code "$@" &
server=$!
trap 'kill $server 2>/dev/null || true' INT TERM
for _ in $(seq 1 720); do
  if ! kill -0 "$server" 2>/dev/null; then echo "SGLang exited during start-up"; exit 1; fi
  if curl -sf "http://127.0.0.1:$PORT/model_info" >/dev/null \
     && "$PY" -m sglang_patch verify --live-only --dump-dir "$DUMP_DIR" >/dev/null 2>&1; then
    # the hook is up: one probe request of ours must now come back as a correct dump
    if ! "$PY" -m sglang_patch verify --live-only --dump-dir "$DUMP_DIR" \
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
