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


def test_a_regenerating_runs_eta_counts_the_turns_left_at_its_turn_rate() -> None:
    from producer.status import generation_eta
    from producer.status_text import render

    # Given 100 samples, 10 of which ended their generation with 30 turns between them, 6
    # turns made of samples still generating, all 36 in 72 s (0.5 turns/s)
    st = Status(total=100, done=8, queued=80, unacked=2, running=2, retrying=0, failed=1,
                rejected=1, stale=0, bytes=0, tokens=0, rate_per_s=0.1, eta_s=920.0,
                generation={"turns": 36, "tokens": 3600, "seconds": 300, "first_at": 1000,
                            "last_at": 1072, "samples": 10, "sample_turns": 30})
    # Then the turns left are 88 samples at 3 turns each, less the 6 made: 258, at 0.5/s
    assert generation_eta(st) == 516.0
    line = next(x for x in render(dataclasses.replace(st, generation_eta_s=516.0), "r", "m")
                if x.startswith("generate"))
    assert line == ("generate  36 turns regenerated, 3600 tokens (50.0 tokens/s decoded, "
                    "12.0 tokens/s per request); ETA 8m36s")
    # And the run's generation settings, from its fingerprint, under it
    said = {"max_new_tokens": 512, "temperature": 0.6, "top_p": 0.95, "top_k": -1,
            "stop_token_ids": [7], "reasoning": "drop", "on_length": "reject",
            "on_empty": "keep"}
    text = render(dataclasses.replace(st, generation_settings=said, generation_eta_s=516.0),
                  "r", "m")
    assert text[text.index(line) + 1] == (
        "          at most 512 new tokens a turn, temperature 0.6, top-p 0.95, top-k -1, stop "
        "ids 7; reasoning drop, a cut turn reject, an empty reply keep")
    # And before any sample's generation has ended, no turns per sample are known: no ETA
    assert generation_eta(dataclasses.replace(st, generation={"turns": 3, "first_at": 1,
                                                              "last_at": 5})) is None
