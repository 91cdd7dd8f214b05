"""The Redis the farm runs on: one way to connect, and whether it survives a restart.

Redis is both the Celery broker and the run index. One without persistence (``appendonly
no``, the default of a distribution's package and of this machine's service) loses every
queued message on a restart; the output disk keeps what is done, but the run stalls until
someone re-runs ``enqueue``. So the farm refuses such a Redis unless told otherwise.
"""

from __future__ import annotations

import logging

import redis

from worker.errors import ConfigError
from worker.settings import Settings

log = logging.getLogger("hsfarm.broker")


def client(settings: Settings, socket_timeout_s: float = 30.0) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url, socket_timeout=socket_timeout_s,
                                socket_connect_timeout=5, health_check_interval=30)


def where(settings: Settings) -> str:
    """The Redis address without its password, for messages."""
    return settings.redis_url.rsplit("@", 1)[-1]


def check_persistence(r: redis.Redis, settings: Settings) -> None:
    """Refuse a Redis that keeps nothing on disk, unless ``FARM_ALLOW_VOLATILE_REDIS`` is set.

    Raises:
        ConfigError: appendonly is off and volatility was not allowed.
        redis.RedisError: Redis does not answer.
    """
    try:
        aof = str(r.config_get("appendonly").get("appendonly", "")).lower()
    except redis.ResponseError as e:  # CONFIG renamed or disabled (managed Redis)
        log.warning("cannot read the persistence settings of Redis at %s (%s); make sure it "
                    "runs with appendonly yes, or a restart loses the queue", where(settings), e)
        return
    if aof == "yes":
        return
    message = (f"Redis at {where(settings)} keeps nothing on disk (appendonly {aof or '?'}): "
               "a restart of it loses every queued sample and the run index. Start it with "
               "ops/start-redis.sh (AOF, appendfsync always), or set "
               "FARM_ALLOW_VOLATILE_REDIS=1 to accept that risk")
    if not settings.allow_volatile_redis:
        raise ConfigError(message)
    log.warning("%s (allowed by FARM_ALLOW_VOLATILE_REDIS)", message.split(": a restart")[0])
