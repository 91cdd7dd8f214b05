"""Each delivery's time limits follow its sample's size (worker/core/time_limits.py)."""

from __future__ import annotations

import pytest

from worker.core import time_limits
from worker.core.errors import ConfigError
from worker.core.settings import Settings

KIMI_PER_TOKEN = 8 + 2 * 4 * 7168  # id + final + 3 aux states, bf16, H = 7168


def test_a_64k_sample_gets_its_bytes_time_on_top_of_the_base_limit() -> None:
    # Given the defaults: 900 s base, 50 MB/s floor
    s = Settings()
    # When a 2k-token and a 64k-token sample at Kimi's size get their limits
    short = time_limits.for_tokens(s, 2048, KIMI_PER_TOKEN)
    long = time_limits.for_tokens(s, 65536, KIMI_PER_TOKEN)
    # Then the 2k one is about the base, the 64k one adds 3.76 GB at 50 MB/s (75 s)
    assert short.hard_s == pytest.approx(900 + 2048 * KIMI_PER_TOKEN / 50e6)
    assert long.hard_s == pytest.approx(900 + 65536 * KIMI_PER_TOKEN / 50e6)
    assert long.hard_s - short.hard_s > 70
    # And the soft limit comes 20 s before the hard one (a fifth of it for short limits)
    assert long.soft_s == pytest.approx(long.hard_s - 20)
    assert time_limits.soft_for(20) == pytest.approx(16)
    assert long.as_celery() == (long.hard_s, long.soft_s)


def test_a_records_bound_is_its_bytes_at_most_max_tokens() -> None:
    s = Settings(max_tokens=65536, task_time_limit_s=100, dump_timeout_s=30,
                 min_sample_bytes_per_s=1e6)
    # a 10 kB record has at most 10,000 tokens; a 1 MB one at most FARM_MAX_TOKENS
    assert time_limits.for_record(s, 10_000, 100).hard_s == pytest.approx(100 + 1.0)
    assert time_limits.for_record(s, 1 << 20, 100).hard_s == pytest.approx(100 + 6.5536)


def test_a_longest_sample_outliving_the_visibility_timeout_is_refused_with_the_fix() -> None:
    # Given 128k-token samples at Kimi's size (7.5 GB) and a floor of 25 MB/s: 900 + 300 s
    # of limit, + 60 s of backoff, is over the default visibility timeout of 1200 s
    s = Settings(max_tokens=131072, min_sample_bytes_per_s=25e6)
    # Then the worker refuses to start, naming the value that fits
    with pytest.raises(ConfigError, match=r"FARM_VISIBILITY_TIMEOUT_S=\d+ or more"):
        time_limits.check_visibility(s, KIMI_PER_TOKEN)
    # And at the default floor the default visibility timeout covers them
    time_limits.check_visibility(Settings(max_tokens=131072), KIMI_PER_TOKEN)


def test_the_floor_rate_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="FARM_MIN_SAMPLE_BYTES_PER_S"):
        Settings(min_sample_bytes_per_s=0)
