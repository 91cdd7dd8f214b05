"""The state tier's one redis-server, shared by every test of tests/state.

Each test gets it emptied (``FLUSHALL``) first: the tests run one at a time in one pytest
process, and the broker's keys (kombu's unacked set, the owners' hash) have fixed names, so
neither unique keys nor a database per test would keep two tests apart that a flush does not.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from producer.localfarm.farm import LocalFarm
from tests.conftest import private_redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFarm]:
    """A private redis-server (AOF always, as the broker's) for the whole tier."""
    with private_redis(tmp_path_factory.mktemp("state") / "redis") as farm:
        yield farm


@pytest.fixture
def redis_url(redis_server: LocalFarm) -> str:
    """The tier's Redis, emptied for this test: a farm's ``redis_url``."""
    redis_server.redis().flushall()
    return redis_server.env()["REDIS_URL"]
