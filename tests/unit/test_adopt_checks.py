"""``adopt``'s checks as functions: each problem of an hsfarm file's header named by field, and
how many prefix rows are compared against the chance a foreign minority goes unseen. No
processes.
"""

from __future__ import annotations

import pytest

from engine_dump import contracts as c
from producer.adopt import header as ah
from producer.adopt import rows as ar
from worker.core import weights
from worker.core.store import M_FINGERPRINT


def test_header_problems_name_each_field() -> None:
    fp = c.Fingerprint(config_sha256="x", tokenizer_sha256="x", chat_template_sha256="x",
                       layers_to_capture=(2, 4, 5), layer_convention="x", hidden_size=64,
                       dtype=c.DTYPE_BF16, max_tokens=8192, overlong="reject")
    assert ah.problems({}, fp, "w1") == []
    assert ah.problems({c.M_LAYERS: "[2, 4, 5]", M_FINGERPRINT: fp.id,
                        weights.M_WEIGHTS_ID: "w1"}, fp, "w1") == []
    got = ah.problems({c.M_LAYERS: "[1, 2, 3]", M_FINGERPRINT: "f", weights.M_WEIGHTS_ID: "w2",
                       c.M_DUMP_DTYPE: c.DTYPE_FP8}, fp, "w1")
    assert [g.split(" ")[3] for g in got] == ["layers", "fingerprint", "weights", "dtype"]


def test_prefix_rows_and_miss_probability() -> None:
    assert ar.prefix_rows(3).tolist() == [0, 1, 2]
    rows = ar.prefix_rows(5000)
    assert rows[0] == 0 and rows[-1] == ar.PREFIX_TOKENS - 1 and len(rows) == ar.ROWS
    assert ar.miss_probability(100, 2, 10) == pytest.approx(90 * 89 / (100 * 99), rel=1e-9)
    assert ar.miss_probability(100, 0, 10) == 1.0
