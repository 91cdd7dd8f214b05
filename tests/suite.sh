#!/usr/bin/env bash
# The whole suite, as `make test` runs it (and so .ci/run): two lines at once on two cores.
#   line 1: make test-tiers, then (once line 2 has built the side venvs) make test-vllm-farm,
#           make test-trainers
#   line 2: make lint, make build-side-venvs, make test-vllm-hook, make test-sglang,
#           make test-live
# The suite is CPU-bound (both cores busy from start to end), so the lines are balanced to end
# together: each step's wall time and CPU time (its processes, children included) is printed.
# Each line runs all its steps even after one fails, so one flaky step hides no other; the
# suite then prints every step's result and times, and exits 1 when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# The suite starts over a thousand Python processes of this tree (workers, servers, commands);
# where the environment forbids writing bytecode, each would compile hsfarm's modules again
# (~0.2 s of CPU a process): let Python cache them in the clone's __pycache__ (git ignores it).
unset PYTHONDONTWRITEBYTECODE
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT

step() {  # step NAME: make NAME; its exit code, wall and CPU seconds kept in $results/NAME
  local rc=0 TIMEFORMAT="%R %U %S"
  { time make --no-print-directory "$1" 2>&3; } 3>&2 2>"$results/$1.time" || rc=$?
  read -r wall user sys <"$results/$1.time"
  echo "$rc ${wall%.*} $(( ${user%.*} + ${sys%.*} ))" >"$results/$1"
  return 0
}

line1() {
  step test-tiers
  # the side venvs are line 2's to build: wait for that step to end, whatever its result
  while [ ! -e "$results/build-side-venvs" ]; do sleep 5; done
  step test-vllm-farm
  step test-trainers
}

line2() {
  step lint
  step build-side-venvs
  step test-vllm-hook
  step test-sglang
  step test-live
}

line1 &
one=$!
line2 &
two=$!
wait "$one" "$two"

failed=0
echo "==> the suite, step by step (wall time; CPU time of its processes)"
for name in test-tiers test-vllm-farm test-trainers lint build-side-venvs test-vllm-hook \
    test-sglang test-live; do
  read -r rc secs cpu <"$results/$name"
  if [ "$rc" = 0 ]; then verdict=passed; else verdict="FAILED (exit $rc)"; failed=1; fi
  printf '    %-17s %-18s %3dm%02ds   cpu %3dm%02ds\n' "$name" "$verdict" \
    $((secs / 60)) $((secs % 60)) $((cpu / 60)) $((cpu % 60))
done
exit "$failed"
