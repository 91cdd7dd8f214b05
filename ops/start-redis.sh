#!/usr/bin/env bash
# Usage: REDIS_PASSWORD=... ops/start-redis.sh [extra redis-server args]
# Starts Redis with ops/redis.conf (AOF always, noeviction, loopback only) and the password
# from the environment. What it prints when right: redis-server's "Ready to accept connections".
set -euo pipefail
case "${1:-}" in
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
esac
: "${REDIS_PASSWORD:?set REDIS_PASSWORD (and put the same in REDIS_URL for the farm)}"
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /var/lib/hsfarm-redis
# The config (with the password) is read from stdin ("-"), so the password is neither in
# `ps` nor in a file.
exec redis-server - "$@" < <(printf 'include %s\nrequirepass "%s"\n' "$here/redis.conf" \
  "$REDIS_PASSWORD")
