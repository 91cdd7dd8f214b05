#!/usr/bin/env bash
# The one device check of this project, for a lent GPU machine (see the device tool's README):
#   run(command="bash bench/gpu_run.sh", timeout_s=540)
# It needs only python3 with torch and safetensors (the GPU image has both) and writes the
# benchmark's JSON and log to $OUT, then into docs/ by hand (docs/benchmarks.md).
set -euo pipefail
out=${OUT:-/tmp/hsfarm-gpu}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  df -h /dev/shm /tmp
  python3 -c "import sys, torch, safetensors; print(sys.version.split()[0], torch.__version__, safetensors.__version__)"
} 2>&1 | tee "$out/env.txt"
# tmpfs as in production when it has room for a few 470 MB dumps; else the next best thing
free_kb=$(df --output=avail -k /dev/shm | tail -1)
dump_dir=/dev/shm
[ "$free_kb" -gt 8000000 ] || dump_dir=/tmp
PYTHONUNBUFFERED=1 python3 bench/dump_overhead.py --tokens 2048 8192 --iters 12 \
  --dump-dir "$dump_dir" --out "$out/dump_overhead.json" 2>&1 | tee "$out/dump_overhead.log"
# the same with the hook quantizing to fp8 (FARM_STORE_DTYPE=fp8_e4m3): docs/fp8.md
PYTHONUNBUFFERED=1 python3 bench/dump_overhead.py --tokens 2048 8192 --iters 12 \
  --dump-dir "$dump_dir" --dump-dtype fp8_e4m3 --out "$out/dump_overhead_fp8.json" 2>&1 \
  | tee "$out/dump_overhead_fp8.log"
