#!/usr/bin/env bash
# Usage: ops/preflight.sh        (with the farm's environment: set -a; . /etc/hsfarm/env; set +a)
#        PYTHON=/opt/hsfarm/.venv/bin/python SGLANG_PYTHON=/opt/sglang/bin/python ops/preflight.sh
# Checks a host before and during a run and changes nothing (no directory is created, no
# request is dumped). One line per check: OK, WARN (works, but read it) or FAIL (with what to
# do): settings, Redis (AOF, noeviction), the server, the run and how much of it remains, the
# output disk sized to that remaining work, the dump dir (space, tmpfs), the hook's ready
# marker, the GPUs and who holds them (process, systemd unit), and the SGLang plugin (with
# SGLANG_PYTHON, or this python when SGLang is installed in it; a WARN line says when they
# did not run). Exit code: 0 when no line says FAIL, 1 otherwise, 2 when the farm's python
# cannot be found. Python: $PYTHON, else the .venv next to ops/, else python3.
set -euo pipefail

case "${1:-}" in
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  "") ;;
  *) echo "ops/preflight.sh takes no arguments (got: $*); see ops/preflight.sh --help" >&2
     exit 2 ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$root/.venv/bin/python" ]; then PY=$root/.venv/bin/python; else PY=python3; fi
fi
# The farm's code and its libraries must import in that python; say so plainly if not.
if ! err=$(PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c 'import producer.preflight' 2>&1); then
  echo "FAIL  environment: $PY cannot run the farm's code ($(printf '%s\n' "$err" | tail -n 1))."
  echo "      Run preflight with the project's python: PYTHON=/opt/hsfarm/.venv/bin/python" \
       "ops/preflight.sh (or activate that venv, or make .venv/.installed in the checkout)."
  exit 2
fi
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m producer.preflight
