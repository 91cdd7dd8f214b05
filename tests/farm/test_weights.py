"""A real farm whose server serves other weights than the run's: the workers refuse it at first,
take nothing, and start once the run's checkpoint is served.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from tests.support.checkpoints import bos_row_changed
from worker.core import weights
from worker.core.outdir import MANIFEST

# --- the server's weights against the run's ------------------------------------------------------

def fine_tune(base: Path, out: Path) -> Path:
    """``base`` with one tensor perturbed (its largest: a fine-tune's change that the sampled
    ranges see): the same config and tokenizer, other weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    name = max(tensors, key=lambda k: tensors[k].numel())
    tensors[name] = tensors[name] + 0.05
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_server_serving_other_weights_than_the_run_is_refused_at_first_and_later_starts(
        tmp_path: Path, tiny_model: Path) -> None:
    from producer.localfarm.farm import wait_until
    from tests.conftest import wait_finished
    from tests.support.faults import enqueue, running_farm
    from worker.state.queue_scan import broker_depth

    tuned = fine_tune(tiny_model, tmp_path / "tuned")
    assert weights.weights_identity(tuned)["id"] != weights.weights_identity(tiny_model)["id"]
    # Given the server serving the fine-tune while the workers' FARM_MODEL_PATH holds the base
    with running_farm(tmp_path, server_args=["--model", str(tuned)],
                      env={"FARM_MODEL_PATH": str(tiny_model)}) as farm:
        keys = enqueue(farm, tmp_path, 4)
        queue, out = farm.queue(), farm.output_dir

        def refused(name: str, files: int) -> str:
            w = farm.start_worker(name, concurrency=1, wait=False)
            wait_until(lambda: not w.alive() or b" ready." in w.log.read_bytes(), 120,
                       f"worker {name} to start or stop")
            time.sleep(1)
            log = w.log.read_text()
            assert not w.alive() and w.popen is not None and w.popen.returncode == 2, log[-3000:]
            assert " ready." not in log
            assert broker_depth(farm.redis(), queue) == (4, 0)
            assert len(list((out / "samples").rglob("*.safetensors"))) == files
            return log

        # When a worker starts for the first time: it exits 2 before taking anything, naming
        # both identities and both ways on (no hidden states were written under the run yet)
        log = refused("first", 0)
        tuned_id = weights.weights_identity(tuned)["id"]
        base_id = weights.weights_identity(tiny_model)["id"]
        assert f"the server at {farm.env()['FARM_SERVER_URL']} serves weights {tuned_id}" in log
        assert f"FARM_MODEL_PATH={tiny_model} holds {base_id}" in log
        assert "serve the checkpoint of FARM_MODEL_PATH" in log
        assert f"remove {out / MANIFEST}" in log
        assert not (out / "canary.safetensors").exists()
        # And once the server serves the base, the run works
        farm.procs["server"].stop()
        farm.start_server(["--model", str(tiny_model)])
        farm.start_worker("good", concurrency=1)
        wait_finished(farm, 4)
        assert len(list((out / "samples").rglob("*.safetensors"))) == len(keys)
        farm.procs["good"].stop()
        # When the server is later restarted with the fine-tune, a worker's start refuses it
        # too, and the fix names the server: the run's weights are the base's
        more = enqueue(farm, tmp_path, 4, start=4)
        assert len(more) == 4
        farm.procs["server"].stop()
        farm.start_server(["--model", str(tuned)])
        log = refused("later", 4)
        assert f"serves weights {tuned_id}" in log and f"the run's weights are {base_id}" in log
        assert "restart the server with the run's checkpoint" in log


def test_a_server_whose_checkpoint_differs_in_one_embedding_row_is_refused(
        tmp_path: Path, tiny_model: Path) -> None:
    from producer.localfarm.farm import wait_until
    from tests.support.faults import enqueue, running_farm
    from worker.state.queue_scan import broker_depth

    # Given the server serving a copy of the run's checkpoint whose only change is the BOS
    # token's embedding row (between the sampled ranges), the workers holding the original
    changed = bos_row_changed(tiny_model, tmp_path / "bos")
    with running_farm(tmp_path, server_args=["--model", str(changed)],
                      env={"FARM_MODEL_PATH": str(tiny_model)}) as farm:
        enqueue(farm, tmp_path, 2)
        # When a worker starts
        w = farm.start_worker("w", concurrency=1, wait=False)
        wait_until(lambda: not w.alive() or b" ready." in w.log.read_bytes(), 120,
                   "the worker to start or stop")
        # Then it refuses the server before taking anything, naming both identities
        log = w.log.read_text()
        assert not w.alive() and w.popen is not None and w.popen.returncode == 2, log[-3000:]
        changed_id = weights.weights_identity(changed)["id"]
        base_id = weights.weights_identity(tiny_model)["id"]
        assert changed_id != base_id
        assert f"serves weights {changed_id}" in log and f"holds {base_id}" in log
        assert broker_depth(farm.redis(), farm.queue()) == (2, 0)
        assert not list((farm.output_dir / "samples").rglob("*.safetensors"))


def same_states_other_bytes(base: Path, out: Path) -> Path:
    """``base`` with its lm_head moved: other bytes inside the weights identity's sampled
    ranges, and the same hidden states (the dump holds no logits): only the identity tells it
    from the run's checkpoint, the canary cannot."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.05
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_running_worker_writes_no_dump_of_other_weights_and_pauses_saying_why(
        tmp_path: Path, tiny_model: Path) -> None:
    from producer.localfarm.farm import wait_until
    from tests.conftest import assert_farm_invariants, wait_finished
    from tests.support.faults import enqueue, failed, running_farm

    other = same_states_other_bytes(tiny_model, tmp_path / "other")
    other_id = weights.weights_identity(other)["id"]
    assert other_id != weights.weights_identity(tiny_model)["id"]
    with running_farm(tmp_path) as farm:
        # Given a run under way: its worker started on the run's checkpoint
        w = farm.start_worker("w1", concurrency=2)
        keys = enqueue(farm, tmp_path, 4)
        wait_finished(farm, 4)
        out = farm.output_dir / "samples"
        # When the server restarts on a copy whose bytes differ inside the identity's sample
        # (its hidden states are the run's: the canary passes), and samples are queued
        farm.procs["server"].stop()
        farm.start_server(["--model", str(other)])
        more = enqueue(farm, tmp_path, 4, start=4)
        # Then the running worker writes no final file of them, and pauses saying why
        wait_until(lambda: f"serves weights {other_id}" in w.log.read_text(), 120,
                   "the worker to refuse the dumps")
        time.sleep(3)
        assert len(list(out.rglob("*.safetensors"))) == 4
        log = w.log.read_text()
        assert "paused (no attempt spent): ServerMisconfigured" in log, log[-3000:]
        assert w.alive() and not failed(farm)
        # And once the run's checkpoint is served again, the run finishes: 8 files, no attempt
        # spent on the refused dumps
        farm.procs["server"].stop()
        farm.start_server()
        wait_finished(farm, 8)
        assert_farm_invariants(farm, keys + more)
