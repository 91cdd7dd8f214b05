"""``audit --prove``: every whole final file's final state against the live server's logprobs.

Each file's ``input_ids`` go to the server again, asking for the prompt logprobs, under a rid
that is not the farm's (the hook dumps nothing); its stored rows are proven against them
(``worker/core/proof.py``). Unlike the worker's proof this is another forward pass than the
one the file came from, so an engine whose numbers depend on the batch (most GPU kernels) may
differ by more than rounding: ``slack`` nats are added to every row's bound for that.
Test: tests/farm/test_proof.py::test_audit_prove_names_the_files_that_fail.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine_dump import engines
from engine_dump.dumpfile import DUMP_SUFFIX, T_INPUT_IDS
from worker.core import proof, tensorfile
from worker.core.errors import FarmError
from worker.core.settings import Settings
from worker.server.client import ServerClient

DEFAULT_SLACK = 0.02  # nats: a batch-dependent engine's second forward pass (docs/proof.md)


@dataclass
class ProveReport:
    proven: int = 0
    rows: int = 0
    worst_error: float = 0.0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (key, why)

    def lines(self, show: int = 50) -> list[str]:
        out = [f"proven: {self.proven} ({self.rows} rows, worst |Δ logprob| "
               f"{self.worst_error:.3g})", f"proof failed: {len(self.failed)}"]
        return out + [f"  proof failed {k}: {why}" for k, why in self.failed[:show]]


async def _prove_one(client: ServerClient, head: proof.LmHead, path: Path, rows_per: int,
                     dtype: str, slack: float) -> proof.Verdict:
    with open(path, "rb") as f:
        header = tensorfile.read_header_fd(f.fileno(), path.name)
        e = header.tensors[T_INPUT_IDS]
        ids = np.frombuffer(proof.pread(f.fileno(), e.nbytes, header.data_start + e.begin),
                            dtype="<i8")
        rid = f"hsfarm-prove-{uuid.uuid4().hex}"  # not a farm rid: the hook dumps nothing
        answer = await client.generate(rid, ids.tolist(), prompt_logprobs=True)
        said = engines.prompt_logprobs((await client.engine()).name, answer, ids.tolist())
        rows = proof.pick_rows(len(ids), rows_per, path.name)
        hidden = proof.read_rows(f.fileno(), header, rows)
    server = np.array([np.nan if v is None else v for v in said], dtype=np.float64)
    return proof.prove(head, hidden, rows, ids, server, dtype, slack)


def prove_files(settings: Settings, model_path: Path, hidden_size: int, dtype: str,
                files: Iterable[Path], rows_per: int, slack: float = DEFAULT_SLACK
                ) -> ProveReport:
    """Prove each file against the server of ``settings``, one request at a time.

    Raises:
        proof.ProofUnavailable: the checkpoint's LM head cannot be read (quantized, absent).
    """
    head = proof.open_lm_head(model_path, hidden_size)
    report = ProveReport()

    async def run() -> None:
        client = ServerClient.of(settings)
        try:
            for path in files:
                key = path.name[: -len(DUMP_SUFFIX)]
                try:
                    v = await _prove_one(client, head, path, rows_per, dtype, slack)
                except (FarmError, ValueError, OSError, KeyError) as e:
                    report.failed.append((key, f"not proven: {type(e).__name__}: {e}"))
                    continue
                report.proven += v.ok
                report.rows += v.rows
                report.worst_error = max(report.worst_error, v.worst_error)
                if not v.ok:
                    report.failed.append((key, v.describe()))
        finally:
            await client.close()

    asyncio.run(run())
    return report
