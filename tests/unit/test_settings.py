"""Settings from the environment: defaults, parsing, invalid combinations."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.core.errors import ConfigError
from worker.core.settings import Settings


def test_defaults_work_on_one_machine() -> None:
    s = Settings.from_env({})
    assert s.redis_url.startswith("redis://127.0.0.1")
    assert s.task_time_limit_s < s.visibility_timeout_s


def test_parsing_each_kind() -> None:
    s = Settings.from_env({
        "REDIS_URL": "redis://h:1/2", "FARM_OUTPUT_DIR": "/x", "FARM_MAX_TOKENS": "4096",
        "FARM_LAYERS_TO_CAPTURE": "2,30 58", "FARM_DUMP_TIMEOUT_S": "30.5",
        "FARM_MIN_FREE_OUTPUT_BYTES": "1e9",
    })
    assert s.redis_url == "redis://h:1/2" and s.output_dir == Path("/x")
    assert s.max_tokens == 4096 and s.layers_to_capture == (2, 30, 58)
    assert s.dump_timeout_s == 30.5 and s.min_free_output_bytes == 10**9


@pytest.mark.parametrize(("env", "message"), [
    ({"FARM_MAX_TOKENS": "many"}, "FARM_MAX_TOKENS='many'"),
    ({"FARM_OVERLONG": "drop"}, "FARM_OVERLONG must be"),
    ({"FARM_LAYERS_TO_CAPTURE": "1,2"}, "needs 3 ids"),
    ({"FARM_VISIBILITY_TIMEOUT_S": "100"}, "FARM_VISIBILITY_TIMEOUT_S must exceed"),
    ({"FARM_DUMP_TIMEOUT_S": "2000"}, "must exceed FARM_DUMP_TIMEOUT_S"),
    ({"FARM_CANARY_LOCK_TTL_S": "1"}, "FARM_CANARY_LOCK_TTL_S must be >= 3"),
    ({"FARM_RECONCILE_CONFIRM_S": "0.5"}, "FARM_RECONCILE_CONFIRM_S >= 1"),
])
def test_invalid_settings_say_what_is_wrong(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.from_env(env)


def test_settings_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Settings().max_tokens = 3  # type: ignore[misc]


def test_the_settings_reference_page_is_the_one_the_code_generates() -> None:
    # Given docs/settings.md, whose table is generated from the settings object
    page = (Path(__file__).resolve().parents[2] / "docs" / "settings.md").read_text()
    # When the table is generated again from the code
    table = Settings.reference()
    # Then the page holds it unchanged, and every field has a meaning
    assert table in page, "docs/settings.md is stale: python -m producer settings --reference"
    assert "|  |" not in table and table.count("\n") == len(Settings.__dataclass_fields__) + 2
