"""The dashboard's history series: a day of one-second samples is thinned evenly to at most
1,000 points, the newest kept. A pure function; no farm, Flower or browser.
"""

from __future__ import annotations

import itertools


def test_sampled_series_are_thinned_evenly_keeping_the_newest() -> None:
    from producer.dashboard.data import thinned

    points = [{"t": i} for i in range(8640)]
    shown = thinned(points, 1000)
    assert len(shown) <= 1000 and shown[-1] == {"t": 8639}
    steps = {b["t"] - a["t"] for a, b in itertools.pairwise(shown)}
    assert steps == {9} and thinned(points[:10], 1000) == points[:10]
