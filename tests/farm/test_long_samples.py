"""A 64k-token sample through the farm: real workers, the synthetic server, tmpfs dumps.

H = 512 keeps it lean (269 MB of dumps; at Kimi's H = 7168 it is 3.76 GB: bench/long_samples.py
measures that, docs/benchmarks.md). What it proves at any H: FARM_MAX_TOKENS up to the
server's context, the server's 8 prefill chunks, a delivery's time limit sized by its sample
(the sample takes longer than the base limit and is not cut), the streamed write and read-back
(the worker's pool process stays under 250 MB of peak RSS).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from engine_dump.dumpfile import T_HIDDEN
from producer.localfarm.farm import LocalFarm
from sglang_patch.synthetic import SyntheticModel, ensure_synthetic_model
from tests.conftest import CACHE, FAST_ENV, assert_farm_invariants, wait_finished
from worker.core import outdir

H = 512
TOKENS = 65536
BASE_LIMIT_S = 12.0  # the limit of a short sample; this one takes longer
MAX_RSS_MB = 250


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_64k_sample_goes_through_the_farm_under_a_limit_sized_for_it(tmp_path: Path) -> None:
    # Given the synthetic server (H=512, context 64k + 8, prefill chunks of 8192, paced to
    # 4,000 tokens/s: ~16 s for the sample) and one worker whose base time limit is 12 s
    shm = Path(tempfile.mkdtemp(prefix="hsfarm-test-long.", dir="/dev/shm"))
    env = {**FAST_ENV, "FARM_MAX_TOKENS": str(TOKENS), "FARM_TASK_TIME_LIMIT_S": str(BASE_LIMIT_S),
           "FARM_DUMP_TIMEOUT_S": "2", "FARM_VISIBILITY_TIMEOUT_S": "90",
           "FARM_MIN_SAMPLE_BYTES_PER_S": "8e6"}  # 269 MB: + 34 s for this sample
    farm = LocalFarm(tmp_path / "farm", model="synthetic", cache_dir=CACHE, dumps=shm,
                     chunked_prefill_size=8192, extra_env=env)
    try:
        farm.start_redis()
        farm.start_server(["--hidden-size", str(H), "--context-length", str(TOKENS + 8),
                           "--tokens-per-s", "4000"])
        farm.start_worker("w1", concurrency=1)
        ids = [(i * 7919) % 640 + 1 for i in range(TOKENS)]
        data = tmp_path / "long.jsonl"
        data.write_text(json.dumps({"id": "long64k", "input_ids": ids}) + "\n")
        # When it is enqueued
        assert farm.cli("enqueue", str(data), "--no-progress").returncode == 0
        wait_finished(farm, 1, timeout_s=120)
        # Then it is done, one verified file, and its task ran past the base limit uncut
        assert_farm_invariants(farm, ["long64k"])
        log = farm.procs["w1"].log.read_text()
        took = re.search(r"long64k\] succeeded in ([\d.]+)s", log)
        assert took is not None, log[-2000:]
        assert float(took.group(1)) > BASE_LIMIT_S
        assert "SoftTimeLimitExceeded" not in log and "a2 " not in log
        # And the worker's pool process peaked under 250 MB of RSS
        pool = farm.procs["w1"].children()
        assert pool and max(_peak_rss_mb(pid) for pid in pool) <= MAX_RSS_MB
        # And the file holds the synthetic model's values at the first and last positions
        model = SyntheticModel(ensure_synthetic_model(CACHE, H, 61))
        with safe_open(str(outdir.final_path(farm.output_dir, "long64k")), "pt") as f:
            hidden = f.get_slice(T_HIDDEN)
            assert tuple(hidden.get_shape()) == (TOKENS, H)
            for lo in (0, TOKENS - 4):
                want, _ = model.rows(ids[lo : lo + 4], range(lo, lo + 4))
                assert torch.equal(hidden[lo : lo + 4], want)
    finally:
        farm.close(kill=True)
        shutil.rmtree(shm, ignore_errors=True)
