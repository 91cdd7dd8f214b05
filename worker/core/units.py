"""How a byte count reads to a person: the one formatter every message, status line and
report uses, so a need of a few MB never prints as ``0.00 GB``."""

from __future__ import annotations

_SCALES = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def size_text(n: float) -> str:
    """``n`` bytes in the largest decimal unit it reaches: ``1.2 GB``, ``350.0 MB``, ``12 B``;
    under 10 of a unit two decimals, so ``1.25 GB`` and ``1.26 GB`` stay apart."""
    for unit, scale in _SCALES:
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if abs(value) < 10 else f"{value:.1f} {unit}"
    return f"{n:.0f} B"
