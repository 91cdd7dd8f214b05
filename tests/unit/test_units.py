"""How byte counts read in messages (worker/core/units.py)."""

from __future__ import annotations

from worker.core.units import size_text


def test_each_size_reads_in_the_unit_it_reaches() -> None:
    assert size_text(0) == "0 B"
    assert size_text(999) == "999 B"
    assert size_text(1_048_576) == "1.05 MB"
    assert size_text(86_000_000) == "86.0 MB"
    assert size_text(1_250_000_000) == "1.25 GB"
    assert size_text(4.2e12) == "4.20 TB"
    assert size_text(-3_000_000) == "-3.00 MB"
