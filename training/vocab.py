"""Token frequencies over loss-masked tokens, and SpecForge's draft-vocabulary mapping.

Computed from ids and masks only (never hidden states). The mapping is SpecForge's
``process_token_dict_to_mappings``: the ``draft_vocab_size`` most frequent target tokens,
sorted; ``d2t[i] = used[i] - i`` (offset to the target id), ``t2d[t] = t is used``. Where fewer
tokens were seen, the lowest unseen ids fill up, as SpecForge does. Ties at the cut are broken
by the lower token id (SpecForge: by first occurrence in its file order): both are top-N sets.
"""

from __future__ import annotations

import numpy as np


def count_masked(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Counts per token id (int64 [max id + 1]) of the tokens where ``mask`` is non-zero."""
    return np.bincount(ids[mask != 0].astype(np.int64, copy=False))


def add_counts(total: np.ndarray, more: np.ndarray) -> np.ndarray:
    """``total + more``, growing ``total`` to the longer length."""
    if len(more) > len(total):
        total = np.concatenate([total, np.zeros(len(more) - len(total), np.int64)])
    total[: len(more)] += more
    return total


def token_freq(counts: np.ndarray) -> dict[int, int]:
    """``{token id: count}`` for the tokens seen (speculators' ``token_freq.pt``)."""
    seen = np.flatnonzero(counts)
    return {int(t): int(counts[t]) for t in seen}


def draft_vocab_mapping(counts: np.ndarray, draft_vocab_size: int,
                        target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [draft_vocab_size], t2d bool [target_vocab_size]).

    Raises:
        ValueError: sizes that cannot hold the mapping, or ids outside the target vocabulary.
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft vocab size {draft_vocab_size} must be in 1..{target_vocab_size}"
                         " (the target vocab size)")
    seen = np.flatnonzero(counts)
    if len(seen) and seen[-1] >= target_vocab_size:
        raise ValueError(f"token id {seen[-1]} is outside the target vocab size "
                         f"{target_vocab_size}")
    if len(seen) >= draft_vocab_size:
        order = np.lexsort((seen, -counts[seen]))  # count descending, then id ascending
        used = np.sort(seen[order[:draft_vocab_size]])
    else:
        unseen = np.setdiff1d(np.arange(draft_vocab_size), seen)
        used = np.sort(np.concatenate([seen, unseen[: draft_vocab_size - len(seen)]]))
    d2t = used - np.arange(len(used))
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[used] = True
    return d2t.astype(np.int64), t2d
