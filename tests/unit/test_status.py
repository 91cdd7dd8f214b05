"""``status``'s wording from its inputs alone: durations read at a glance, an empty index that is
not a finished run, failures grouped by reason whatever the sample keys. No Redis, no farm.
"""

from __future__ import annotations

import dataclasses

from producer.status import Status
from producer.status_text import duration


def test_durations_read_at_a_glance() -> None:
    assert [duration(s) for s in (None, 0.4, 45, 432, 7500, 3 * 86400 + 4 * 3600)] == \
        ["-", "0s", "45s", "7m12s", "2h05m", "3d04h"]


def test_an_empty_index_is_not_a_finished_run() -> None:
    # Given an index that holds nothing (Redis lost it, or nothing was enqueued)
    empty = Status(total=0, done=0, queued=0, unacked=0, running=0, retrying=0, failed=0,
                   rejected=0, stale=0, bytes=0, tokens=0, rate_per_s=0.0, eta_s=None)
    # Then it is not finished (status --check must not pass, --watch must not stop)
    assert not empty.finished
    assert dataclasses.replace(empty, total=3, done=2, failed=1).finished


def test_failures_group_by_reason_whatever_the_sample_keys() -> None:
    from producer.dashboard.data import reason_class

    reasons = [f"Corrupt: dump hsd-{key}-a{n}-n{7 * n}.safetensors: hidden_state has {n} "
               "NaN/Inf values" for n, key in enumerate(["ex-0001", "rec-3fa9c01b2e7d",
                                                          "2024-01-x", "a_b.c"], 1)]
    assert len({reason_class(r) for r in reasons}) == 1, {reason_class(r) for r in reasons}
