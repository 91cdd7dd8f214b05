"""The Redis the farm runs on: one way to connect, who may connect, whether it survives a restart.

Every farm client comes from ``client`` and the broker's from ``celery_tls``, so both share the
TLS settings and the refusal of an open door: whoever reaches an off-machine Redis can read the
corpus or publish tasks, so a non-local ``REDIS_URL`` needs a password unless
``FARM_ALLOW_UNAUTHENTICATED_REDIS``. A Redis without ``appendonly`` loses the queue on a
restart, so it is refused unless ``FARM_ALLOW_VOLATILE_REDIS`` (docs/deployment.md).
Test: tests/unit/test_redis_auth.py::test_which_urls_need_a_password."""

from __future__ import annotations

import logging
import ssl
from typing import Any

import redis

from worker.core import redis_url
from worker.core.errors import ConfigError
from worker.core.settings import Settings

log = logging.getLogger("hsfarm.broker")


def client(settings: Settings, socket_timeout_s: float = 30.0,
           connect_timeout_s: float = 5.0) -> redis.Redis:
    """The farm's Redis client (never ``redis.Redis`` directly).

    Raises:
        ConfigError: the URL is an open door (``check_auth``).
    """
    check_auth(settings)
    return redis.Redis.from_url(settings.redis_url, socket_timeout=socket_timeout_s,
                                socket_connect_timeout=connect_timeout_s,
                                health_check_interval=30,
                                **(tls_options(settings) or {}))


def tls_options(settings: Settings) -> dict[str, Any] | None:
    """redis-py's TLS arguments for a ``rediss://`` URL (None for any other): the server's
    certificate is always verified, against ``FARM_REDIS_CA_FILE`` or the system's CAs.

    kombu passes the same dict to redis-py as Celery's ``broker_use_ssl``; without it kombu
    would accept any certificate for a ``rediss://`` URL.
    """
    if not redis_url.is_tls(settings.redis_url):
        return None
    return {"ssl_cert_reqs": ssl.CERT_REQUIRED,
            "ssl_ca_certs": settings.redis_ca_file or None,
            "ssl_certfile": settings.redis_cert_file or None,
            "ssl_keyfile": settings.redis_key_file or None}


def check_auth(settings: Settings) -> str | None:
    """Refuse a ``REDIS_URL`` off this machine without a password, unless allowed (then the
    warning to show; None when the URL is fine).

    Raises:
        ConfigError: with the URL (password masked) and the ways to fix it.
    """
    url = settings.redis_url
    if redis_url.is_local(url) or redis_url.has_password(url):
        return None
    message = (f"REDIS_URL {redis_url.masked(url)} is not on this machine and has no password: "
               "anyone who reaches that port could read or rewrite the run. Give Redis a "
               "password (requirepass, or an ACL user) and put it in the URL "
               "(redis://USER:PASSWORD@HOST:PORT/0; rediss:// for TLS; ops/RUNBOOK.md, "
               "'Several hosts'), or set FARM_ALLOW_UNAUTHENTICATED_REDIS=1 on a private "
               "network you trust")
    if not settings.allow_unauthenticated_redis:
        raise ConfigError(message)
    return (f"REDIS_URL {redis_url.masked(url)} has no password (allowed by "
            "FARM_ALLOW_UNAUTHENTICATED_REDIS)")


def where(settings: Settings) -> str:
    """The Redis URL with its password masked, for messages."""
    return redis_url.masked(settings.redis_url)


def check_persistence(r: redis.Redis, settings: Settings) -> None:
    """Refuse a Redis that keeps nothing on disk, or that drops transactions when it replays
    its AOF (``replay_loss``), unless ``FARM_ALLOW_VOLATILE_REDIS`` is set.

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
    loss = replay_loss(r)
    if aof == "yes" and loss is None:
        return
    message = (f"Redis at {where(settings)} keeps nothing on disk (appendonly {aof or '?'}): "
               "a restart of it loses every queued sample and the run index. Start it with "
               "ops/start-redis.sh (AOF, appendfsync always), or set "
               "FARM_ALLOW_VOLATILE_REDIS=1 to accept that risk")
    if aof == "yes":
        message = (f"Redis at {where(settings)} {loss}, or set FARM_ALLOW_VOLATILE_REDIS=1 to "
                   "accept that risk")
    if not settings.allow_volatile_redis:
        raise ConfigError(message)
    log.warning("%s (allowed by FARM_ALLOW_VOLATILE_REDIS)", message.split(": a restart")[0])


def replay_loss(r: redis.Redis) -> str | None:
    """Why a restart of this Redis would lose writes its AOF holds, or None.

    With its ``default`` user off, Redis (7.0.15 measured) replays every MULTI/EXEC of its AOF
    as that user and refuses it (``NOPERM ... AOF-loading-client``): every transaction of the
    broker and the run index is gone after a restart, and Redis starts anyway.
    """
    try:
        user = r.acl_getuser("default") or {}
    except redis.ResponseError:  # ACL GETUSER not allowed to this user: nothing to tell
        return None
    flags = user.get("flags")
    if not isinstance(flags, list) or "off" not in flags:
        return None
    return ("has its default user off: a restart of it drops every transaction in its AOF "
            "(the queue and the run index). Keep the default user on with a password "
            "(requirepass) next to any ACL user (ops/RUNBOOK.md, 'Redis for several hosts')")
