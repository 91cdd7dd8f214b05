"""Each delivery's time limits, from the size of its sample.

A sample's work grows with its dump (86 MB at 2k tokens, 5.5 GB at 128k with H = 7168), so one
limit would be too short for 64k tokens or hours for a hung 2k one: ``hard_s`` is
``FARM_TASK_TIME_LIMIT_S`` + dump bytes / ``FARM_MIN_SAMPLE_BYTES_PER_S`` (docs/settings.md),
``soft_s`` 20 s less (at most a fifth). The main process sets them per message before a pool
process runs it (``worker.request.OwnedRequest``), from its record's size. Test:
tests/unit/test_time_limits.py::test_a_64k_sample_gets_its_bytes_time_on_top_of_the_base_limit."""

from __future__ import annotations

from dataclasses import dataclass

from worker.core.errors import ConfigError
from worker.core.settings import Settings
from worker.core.units import size_text

SOFT_MARGIN_MAX_S = 20.0  # the soft limit comes this much (at most a fifth) before the hard


@dataclass(frozen=True)
class TimeLimits:
    soft_s: float
    hard_s: float

    def as_celery(self) -> tuple[float, float]:
        """Celery's ``timelimit`` header: (hard, soft)."""
        return (self.hard_s, self.soft_s)


def soft_for(hard_s: float) -> float:
    return hard_s - min(SOFT_MARGIN_MAX_S, hard_s / 5)


def io_s(settings: Settings, dump_bytes: int) -> float:
    """The time a sample's bytes may take beyond a short sample's, at the floor rate."""
    return dump_bytes / settings.min_sample_bytes_per_s


GEN_PREFILL_S = 30.0  # a generation's wait for its batch and its prompt's prefill


def turn_s(settings: Settings, max_new_tokens: int) -> float:
    """How long a regenerated turn of at most ``max_new_tokens`` may take: its tokens at the
    floor rate ``FARM_GEN_MIN_TOKENS_PER_S``, and its prompt's prefill."""
    return max_new_tokens / settings.gen_min_tokens_per_s + GEN_PREFILL_S


def generation_turn_s(settings: Settings) -> float:
    """The longest one regenerated turn may take (``turn_s`` of ``FARM_GEN_MAX_NEW_TOKENS``;
    0 when the run does not regenerate). A delivery has room for one turn beyond its
    extraction's; a sample of more turns may take more deliveries, each resuming at its
    first turn not yet generated (worker/regen/step.py)."""
    if not settings.regenerate:
        return 0.0
    return turn_s(settings, settings.gen_max_new_tokens)


def for_tokens(settings: Settings, tokens: int, bytes_per_token: int) -> TimeLimits:
    """The limits of a delivery whose sample has at most ``tokens`` tokens."""
    hard_s = (settings.task_time_limit_s + io_s(settings, tokens * bytes_per_token)
              + generation_turn_s(settings))
    return TimeLimits(soft_for(hard_s), hard_s)


def for_record(settings: Settings, record_bytes: int, bytes_per_token: int) -> TimeLimits:
    """The limits of a delivery whose record is ``record_bytes`` long, known without reading it: a
    record spends at least one byte per token (text under a byte-level tokenizer, or ``input_ids``
    as numbers and commas), so its bytes, at most ``FARM_MAX_TOKENS``, bound its tokens."""
    return for_tokens(settings, min(record_bytes, settings.max_tokens), bytes_per_token)


def check_visibility(settings: Settings, bytes_per_token: int) -> None:
    """Raises ConfigError when the longest sample's delivery could outlive its message's
    visibility timeout (it would be delivered twice)."""
    longest = for_tokens(settings, settings.max_tokens, bytes_per_token)
    need_s = longest.hard_s + settings.retry_backoff_max_s
    if need_s < settings.visibility_timeout_s:
        return
    raise ConfigError(
        f"a sample of FARM_MAX_TOKENS={settings.max_tokens} tokens "
        f"({size_text(settings.max_tokens * bytes_per_token)} of hidden states) gets a time "
        f"limit of {longest.hard_s:.0f}s (FARM_TASK_TIME_LIMIT_S={settings.task_time_limit_s:g}"
        f" + its bytes at FARM_MIN_SAMPLE_BYTES_PER_S={settings.min_sample_bytes_per_s:g}"
        f"{_generation_words(settings)}); "
        f"with FARM_RETRY_BACKOFF_MAX_S that is {need_s:.0f}s, not under "
        f"FARM_VISIBILITY_TIMEOUT_S={settings.visibility_timeout_s:g}: set "
        f"FARM_VISIBILITY_TIMEOUT_S={int(need_s) + 60} or more")


def _generation_words(settings: Settings) -> str:
    turn_s = generation_turn_s(settings)
    if not turn_s:
        return ""
    return (f" + one regenerated turn, {turn_s:.0f}s: FARM_GEN_MAX_NEW_TOKENS="
            f"{settings.gen_max_new_tokens} at FARM_GEN_MIN_TOKENS_PER_S="
            f"{settings.gen_min_tokens_per_s:g}")
