"""A sample's proof as a worker runs it: the server's prompt logprobs against its dump's rows.

``worker/core/proof.py`` holds the arithmetic; here it meets the server's answer and the
farm's errors. An answer without the logprobs asked for, or with them for other tokens, is the
server's fault (``ServerMisconfigured``: the worker waits, no attempt spent); rows that
disagree are the dump's (``Corrupt``: retried, then recorded failed), never a done sample.
Test: tests/farm/test_proof.py::test_wrong_final_states_never_become_done.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine_dump import engines
from worker.core import proof, tensorfile
from worker.core.errors import Corrupt, ServerMisconfigured
from worker.core.settings import Settings

log = logging.getLogger("hsfarm.proof")


@dataclass(frozen=True)
class Prover:
    """What a worker proves samples with: the mapped LM head and the rate and rows to use."""

    head: proof.LmHead
    rate: float
    rows: int

    @classmethod
    def for_run(cls, settings: Settings, model_path: Path, hidden_size: int) -> Prover | None:
        """The run's prover; None when the proof is off (rate 0) or cannot run on this
        checkpoint (a quantized LM head, say), which is logged once with the reason."""
        if settings.proof_rate <= 0:
            return None
        try:
            head = proof.open_lm_head(model_path, hidden_size)
        except proof.ProofUnavailable as e:
            log.warning("the per-sample proof is off: %s", e)
            return None
        log.info("proof: %s of the samples, %d rows each, against %s %s[%d, %d]",
                 f"{settings.proof_rate:.0%}", settings.proof_rows, head.name, head.dtype,
                 head.vocab_size, hidden_size)
        return cls(head, settings.proof_rate, settings.proof_rows)

    def wanted(self, key: str) -> bool:
        """Whether sample ``key`` is proven (the same answer on every attempt)."""
        return proof.chosen(key, self.rate)

    def check(self, engine: str, answer: Any, input_ids: list[int], fd: int,
              header: tensorfile.Header, dtype: str, rid: str) -> proof.Verdict:
        """Prove one sample's dump (open at ``fd``) against the server's ``answer``.

        Raises:
            ServerMisconfigured: the answer lacks the logprobs, or holds other tokens'.
            Corrupt: rows of the dump disagree with the server's logprobs.
        """
        t0 = time.monotonic()
        try:
            said = engines.prompt_logprobs(engine, answer, input_ids)
        except ValueError as e:
            raise ServerMisconfigured(f"{rid}: the server's prompt logprobs cannot prove its "
                                      f"dump: {e}") from e
        rows = proof.pick_rows(len(input_ids), self.rows, rid)
        server = np.array([np.nan if v is None else v for v in said], dtype=np.float64)
        try:
            hidden = proof.read_rows(fd, header, rows)
        except OSError as e:
            raise Corrupt(f"dump of {rid}: its rows cannot be read for the proof: {e}") from e
        ids = np.asarray(input_ids, dtype=np.int64)
        verdict = proof.prove(self.head, hidden, rows, ids, server, dtype)
        log.info("%s proof: %s +%.2fs", rid, verdict.describe(), time.monotonic() - t0)
        if not verdict.ok:
            raise Corrupt(f"dump of {rid} fails the proof against the server's own logprobs: "
                          f"{verdict.describe()}: its final state is not this sample's "
                          "(shifted, another's, truncated or another layer)")
        return verdict
