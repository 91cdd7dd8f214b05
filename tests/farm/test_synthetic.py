"""The farm end to end on the synthetic server: real workers, Kimi-shaped dumps, every farm
invariant held.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS
from engine_dump.probe import PROBE_IDS
from producer.localfarm.farm import LocalFarm
from tests.conftest import CACHE, FAST_ENV, assert_farm_invariants, wait_finished, write_samples
from tests.support.synthetic import H, synthetic_model
from worker.core import canary as canaries
from worker.core import outdir


def test_the_farm_end_to_end_on_the_synthetic_server(tmp_path: Path) -> None:
    # Given the synthetic server (H=256, 61 layers) paced at 20k tokens/s, two workers
    farm = LocalFarm(tmp_path / "farm", model="synthetic", cache_dir=CACHE,
                     chunked_prefill_size=512, extra_env=dict(FAST_ENV))
    try:
        farm.start_redis()
        farm.start_server(["--hidden-size", str(H), "--tokens-per-s", "20000"])
        farm.start_worker("w1", concurrency=2)
        farm.start_worker("w2", concurrency=2)
        data = tmp_path / "data.json"
        samples = write_samples(data, 24)
        # When the samples are enqueued and the run finishes
        assert farm.cli("enqueue", str(data), "--no-progress").returncode == 0
        wait_finished(farm, 24)
        keys = [str(s["id"]) for s in samples]
        assert_farm_invariants(farm, keys)
        # Then every file holds exactly the synthetic model's values for its tokens
        model = synthetic_model()
        for key in keys:
            t = load_file(str(outdir.final_path(farm.output_dir, key)))
            ids = t[T_INPUT_IDS].tolist()
            hidden, aux = model.rows(ids, range(len(ids)))
            assert t[T_HIDDEN].shape == (len(ids), H)
            assert torch.equal(t[T_HIDDEN], hidden) and torch.equal(t[T_AUX], aux)
        # And the server reports its load, and status shows the admission limits
        url = f"http://127.0.0.1:{farm.server_port}/server_info"
        with urllib.request.urlopen(url, timeout=10) as r:
            info = json.loads(r.read())
        assert info["hsfarm"]["hidden_size"] == H and 0 < info["busy_s"] < info["uptime_s"]
        probes = 2 * len(PROBE_IDS)  # each worker's start-up probe request
        samples_tokens = sum(int(np.asarray(load_file(str(
            outdir.final_path(farm.output_dir, k)))[T_INPUT_IDS]).size) for k in keys)
        # each worker's start-up canary: one records it, the other compares (or, when both
        # recorded at once, the one whose recording did not stand compares too)
        canary = sum(len(x.input_ids) for x in canaries.load(farm.output_dir)[0])
        assert info["tokens_done"] - probes - samples_tokens in (2 * canary, 3 * canary)
        status = json.loads(farm.cli("status", "--json").stdout)
        assert status["admission"]["max_in_flight"] == 8
        assert status["admission"]["in_flight"] == 0 and status["admission"]["dump_bytes_held"] == 0
        assert "in flight 0/8" in farm.cli("status").stdout
    finally:
        farm.close(kill=True)
