#!/usr/bin/env bash
# Usage: ops/preflight.sh     (with the farm's environment: REDIS_URL, FARM_*)
# Checks a host before and during a run; exits 0 only when all is well. Each line says
# OK or FAIL and what to do. When right, every line starts with OK.
set -uo pipefail
PY=${PYTHON:-python3}
fail=0
ok()   { echo "OK    $*"; }
bad()  { echo "FAIL  $*"; fail=1; }

out=${FARM_OUTPUT_DIR:-hsfarm-out}
dumps=${FARM_DUMP_DIR:-/dev/shm/hsfarm-dumps}
mkdir -p "$out" "$dumps" 2>/dev/null
free_out=$(df --output=avail -B1 "$out" | tail -1)
[ "$free_out" -gt $((200 * 1024**3)) ] && ok "output disk $out: $((free_out / 1024**3)) GiB free" \
  || bad "output disk $out: only $((free_out / 1024**3)) GiB free (a sample is ~86 MB; 37k samples ~3.2 TB)"
free_shm=$(df --output=avail -B1 "$dumps" | tail -1)
[ "$free_shm" -gt $((8 * 1024**3)) ] && ok "dump dir $dumps: $((free_shm / 1024**3)) GiB free" \
  || bad "dump dir $dumps: only $((free_shm / 1024**3)) GiB free (Docker's default /dev/shm is 64 MB: set shm_size)"
case "$(stat -f -c %T "$dumps" 2>/dev/null)" in
  tmpfs) ok "dump dir is tmpfs" ;;
  *) bad "dump dir $dumps is not tmpfs: dumps would hit a disk twice" ;;
esac
"$PY" - <<'PYEOF' || fail=1
import sys
import redis
from worker.settings import Settings
s = Settings.from_env()
try:
    r = redis.Redis.from_url(s.redis_url, socket_connect_timeout=3)
    r.ping()
    cfg = {**r.config_get("appendonly"), **r.config_get("appendfsync"),
           **r.config_get("maxmemory-policy")}
except redis.RedisError as e:
    print(f"FAIL  redis at {s.redis_url.split('@')[-1]}: {e}"); sys.exit(1)
want = {"appendonly": "yes", "appendfsync": "always", "maxmemory-policy": "noeviction"}
wrong = {k: cfg.get(k) for k, v in want.items() if cfg.get(k) != v}
print(("FAIL  redis config " + str(wrong) + ": use ops/redis.conf") if wrong
      else "OK    redis reachable, AOF always, noeviction")
sys.exit(1 if wrong else 0)
PYEOF
"$PY" -m producer status >/dev/null 2>&1 && ok "server answers and the run fingerprint resolves" \
  || bad "python -m producer status failed: is the server up (FARM_SERVER_URL)?"
if "$PY" -c "import sglang" 2>/dev/null; then
  "$PY" -m sglang_patch verify --dump-dir "$dumps" | sed 's/^PASS /OK   /' || fail=1
fi
exit $fail
