#!/usr/bin/env bash
# The whole suite, as `make test` runs it (and so .ci/run): two lines at once on two cores.
#   line 1: make test-tiers, then make test-vllm (once line 2 has built the vLLM venv)
#   line 2: make lint, make build-side-venvs, make test-sglang, make test-live, make test-trainers
# Each line runs all its steps even after one fails, so one flaky step hides no other; the
# suite then prints every step's result and time, and exits 1 when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT

step() {  # step NAME: make NAME, its exit code and seconds kept in $results/NAME
  local start=$SECONDS rc=0
  make --no-print-directory "$1" || rc=$?
  echo "$rc $((SECONDS - start))" >"$results/$1"
  return 0
}

line1() {
  step test-tiers
  # the vLLM venv is line 2's to build: wait for that step to end, whatever its result
  while [ ! -e "$results/build-side-venvs" ]; do sleep 5; done
  step test-vllm
}

line2() {
  step lint
  step build-side-venvs
  step test-sglang
  step test-live
  step test-trainers
}

line1 &
one=$!
line2 &
two=$!
wait "$one" "$two"

failed=0
echo "==> the suite, step by step"
for name in test-tiers test-vllm lint build-side-venvs test-sglang test-live test-trainers; do
  read -r rc secs <"$results/$name"
  if [ "$rc" = 0 ]; then verdict=passed; else verdict="FAILED (exit $rc)"; failed=1; fi
  printf '    %-17s %-18s %dm%02ds\n' "$name" "$verdict" $((secs / 60)) $((secs % 60))
done
exit "$failed"
