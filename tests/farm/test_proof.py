"""The per-sample proof in a whole farm: real Redis, real workers, the reference server asked
for its prompt logprobs in each sample's own request, and dumps whose final state passes every
other check but is another position's, another sample's or the pre-norm last layer's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import assert_farm_invariants, wait_finished
from tests.support.faults import attempts, failed, running_farm

pytestmark = pytest.mark.timeout(400)
PROOF_LINE = re.compile(r" (\S+) proof: (\d+) rows agree \(worst \|Δ logprob\| (\S+),")


def records(prefix: str, n: int) -> list[dict[str, object]]:
    """``n`` samples of distinct content (a fault of another sample's rows must differ)."""
    return [{"id": f"{prefix}{i}", "messages": [
        {"role": "user", "content": f"{prefix} question {i}: " + "why " * (5 + 7 * i)},
        {"role": "assistant", "content": f"answer {i} " + "because " * (3 + 11 * i)}]}
        for i in range(n)]


def proof_lines(farm_log: str) -> dict[str, float]:
    """sample rid → the worst |Δ logprob| of its passed proof, from the workers' logs."""
    return {m[1]: float(m[3]) for m in PROOF_LINE.finditer(farm_log)}


def test_wrong_final_states_never_become_done(tmp_path: Path, tiny_model: Path) -> None:
    # Given a server whose dumps of three samples hold a wrong final state on every attempt:
    # shifted by one row, another sample's rows, the pre-norm last layer; and every sample
    # proven
    faults = ["shift:bad-shift", "other:bad-other", "prenorm:bad-prenorm"]
    server = [x for f in faults for x in ("--inject-fault", f)]
    env = {"FARM_PROOF_RATE": "1", "FARM_MAX_ATTEMPTS": "2"}
    with running_farm(tmp_path, server, env=env) as farm:
        farm.start_worker("w1", concurrency=2)
        data = tmp_path / "data.json"
        good = records("ok-", 10)
        bad = [{**r, "id": f"bad-{kind}"} for r, kind in
               zip(records("bad-", 3), ("shift", "other", "prenorm"), strict=True)]
        data.write_text(json.dumps(good + bad))

        # When the farm runs them
        assert farm.cli("enqueue", str(data), "--no-progress").returncode == 0
        wait_finished(farm, 13, timeout_s=240)

        # Then each wrong one failed its proof on both attempts, never done
        reasons = failed(farm)
        for kind in ("shift", "other", "prenorm"):
            assert "fails the proof against the server's own logprobs" in reasons[f"bad-{kind}"]
            assert attempts(farm)[f"bad-{kind}"] == 2
        # And every right one was proven and done: no false alarm
        logs = "".join(p.log.read_text(errors="replace") for p in farm.procs.values()
                       if p.name.startswith("w"))
        passed = proof_lines(logs)
        assert len(passed) == 10, passed
        assert_farm_invariants(farm, [str(r["id"]) for r in good],
                               failed=tuple(str(r["id"]) for r in bad))
        print(f"proof: {len(passed)} samples agree, worst |Δ logprob| "
              f"{max(passed.values()):.3g}; 0 false alarms")


def test_audit_prove_names_the_files_that_fail(tmp_path: Path, tiny_model: Path) -> None:
    # Given a run without the worker's proof, where one sample's final state is shifted by a
    # row on every attempt: it is done, and every other check passes it
    env = {"FARM_PROOF_RATE": "0"}
    with running_farm(tmp_path, ["--inject-fault", "shift:bad-shift"], env=env) as farm:
        farm.start_worker("w1", concurrency=2)
        data = tmp_path / "data.json"
        good = records("ok-", 5)
        data.write_text(json.dumps([*good, {**records("bad-", 1)[0], "id": "bad-shift"}]))
        assert farm.cli("enqueue", str(data), "--no-progress").returncode == 0
        wait_finished(farm, 6, timeout_s=240)
        assert farm.cli("audit", "--no-progress").returncode == 0

        # When the run is audited with --prove against the live server
        res = farm.cli("audit", "--no-progress", "--prove")

        # Then the shifted file alone fails its proof, and the audit says so in its exit code
        assert res.returncode == 1, res.stdout + res.stderr
        assert "proven: 5 (" in res.stdout and "proof failed: 1" in res.stdout, res.stdout
        assert re.search(r"proof failed bad-shift: \d+ of \d+ rows off", res.stdout)
