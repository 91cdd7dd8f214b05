"""``adopt``'s checks as functions: each problem of an hsfarm file's header named by field; the
rows compared over each file's whole length against the chance damage goes unseen; a file read
once for its checksum and rows; an fp8 file judged by the values its bytes round. No processes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_dump.dumpfile import (
    DTYPE_BF16,
    DTYPE_FP8,
    M_DUMP_DTYPE,
    M_LAYERS,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
)
from engine_dump.fingerprint import Fingerprint
from producer.adopt import check as ck
from producer.adopt import header as ah
from producer.adopt import pin as pn
from producer.adopt import rows as ar
from worker.core import canary as cn
from worker.core import checksums, finalfile
from worker.core.finalfile import M_FINGERPRINT


def test_header_problems_name_each_field() -> None:
    fp = Fingerprint(config_sha256="x", tokenizer_sha256="x", chat_template_sha256="x",
                     layers_to_capture=(2, 4, 5), layer_convention="x", hidden_size=64,
                     dtype=DTYPE_BF16, max_tokens=8192, overlong="reject")
    assert ah.problems({}, fp, "w1") == []
    assert ah.problems({M_LAYERS: "[2, 4, 5]", M_FINGERPRINT: fp.id,
                        finalfile.M_WEIGHTS_ID: "w1"}, fp, "w1") == []
    got = ah.problems({M_LAYERS: "[1, 2, 3]", M_FINGERPRINT: "f", finalfile.M_WEIGHTS_ID: "w2",
                       M_DUMP_DTYPE: DTYPE_FP8}, fp, "w1")
    assert [g.split(" ")[3] for g in got] == ["layers", "fingerprint", "weights", "dtype"]


def test_rows_span_the_whole_length_and_the_escape_bound_holds() -> None:
    # Given files of 3 and of 5,000 tokens
    rng = np.random.default_rng(0)
    # When the rows compared are drawn
    assert ar.file_rows(3, rng).tolist() == [0, 1, 2]
    rows = ar.file_rows(5000, rng)
    # Then the first and last are among them, and ROWS more spread over the whole length
    assert rows[0] == 0 and rows[-1] == 4999 and len(rows) == ar.ROWS + 2
    assert len(set(rows.tolist())) == len(rows) and rows[-2] > 2500
    # And a file with 10% of its rows off (anywhere) escapes no more often than the bound says
    damaged = np.zeros(1000, dtype=bool)
    damaged[rng.choice(1000, 100, replace=False)] = True
    escaped = sum(not damaged[ar.file_rows(1000, rng)].any() for _ in range(20000))
    bound = ar.escape_probability(0.10)
    assert bound == pytest.approx(0.9 ** ar.ROWS) and escaped / 20000 <= bound + 0.002
    assert ar.miss_probability(100, 2, 10) == pytest.approx(90 * 89 / (100 * 99), rel=1e-9)
    assert ar.miss_probability(100, 0, 10) == 1.0


def test_batches_bound_files_and_tokens() -> None:
    sizes = [100] * 70 + [40000, 10, 20000, 20000]
    got = [list(r) for r in ar.batches(sizes)]
    assert [len(b) for b in got] == [64, 6, 1, 2, 1]  # 64 files; a long file alone
    assert [i for b in got for i in b] == list(range(len(sizes)))


def test_hash_rows_reads_each_slice_once_for_its_sum_and_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pn, "SLICE_BYTES", 3 * 8 * 2)  # slices of 3 rows of 8 uint16
    arr = np.arange(10 * 8, dtype=np.uint16).reshape(10, 8)
    rows = np.array([0, 2, 3, 7, 9])
    got_sum, got_rows = pn.hash_rows(arr, rows)
    assert got_sum == checksums.of(arr) and np.array_equal(got_rows, arr[rows])


def _fp8_picked(x: torch.Tensor, h: int) -> ck.Picked:
    """A file of an fp8 run holding states ``x`` ([T, 4H]: aux then final), every row."""
    from engine_dump import fp8 as hook

    qa, sa = hook.quantize(x[:, :3 * h], 3)
    qh, sh = hook.quantize(x[:, 3 * h:], 1)
    rows = np.arange(len(x))
    at = {T_AUX: qa.numpy(), T_AUX_SCALE: sa.numpy(), T_HIDDEN: qh.numpy(),
          T_HIDDEN_SCALE: sh.numpy()}
    return ck.picked_of_rows("f", list(range(len(x))), rows, at)


def _server(x: torch.Tensor, h: int) -> np.ndarray:
    """What the server answers for states ``x``: bf16 values, [4, T, H]."""
    v = x.to(torch.bfloat16).float().numpy()
    return np.concatenate([v[:, :3 * h].reshape(len(x), 3, h).transpose(1, 0, 2),
                           v[None, :, 3 * h:]])


def test_an_fp8_file_is_judged_by_what_its_bytes_round_and_never_refused_for_rounding() -> None:
    # Given a model's states (H = 7,168, 20 rows), and the server's states 0.3% off them
    h, gen = 7168, torch.Generator().manual_seed(0)
    x = torch.randn(20, 4 * h, generator=gen) * 2
    x[:, 5] = 300.0  # a massive channel, as real models have
    near = x + 0.003 * x.norm(dim=1, keepdim=True) / (4 * h) ** 0.5 * torch.randn(
        20, 4 * h, generator=gen)

    def judged(file: torch.Tensor, server: torch.Tensor) -> cn.Comparison:
        p, new = _fp8_picked(file.to(torch.bfloat16), h), _server(server, h)
        return cn.compare([p.recorded(new)], [new], cn.layer_names((2, 4, 5)), 0.01, 0.0025)

    # Then the file of those states passes against the server, exactly as against itself
    assert judged(x, x).passed and judged(x, near).passed
    # And one whose rows from 10 on another checkpoint wrote, or shifted by a row, fails
    other = x.clone()
    other[10:] = torch.randn(10, 4 * h, generator=gen) * 2
    shifted = x.clone()
    shifted[11:] = x[10:-1]
    assert not judged(other, x).passed and not judged(shifted, x).passed
    # And states 10% off in every value fail: more than e4m3's rounding
    assert not judged(x * 1.1, x).passed
