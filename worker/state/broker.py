"""The Redis the farm runs on: one way to connect, who may connect, whether it survives a restart.

Farm clients come from ``client``, Celery's TLS from ``tls_options`` and its transport from
``Transport`` (kombu's, its channels safe to close after Redis went away). A non-local
``REDIS_URL`` needs a password unless ``FARM_ALLOW_UNAUTHENTICATED_REDIS``: whoever reaches it
can read the corpus or publish tasks. A Redis without ``appendonly`` loses the queue on a
restart, so it is refused unless ``FARM_ALLOW_VOLATILE_REDIS`` (docs/deployment.md).
Test: tests/unit/test_redis_auth.py::test_which_urls_need_a_password."""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis
from kombu import transport as kombu_transport
from kombu.transport import redis as kombu_redis

from worker.core import redis_url
from worker.core.errors import ConfigError, FarmError, Transient
from worker.core.settings import Settings

log = logging.getLogger("hsfarm.broker")

T = TypeVar("T")
# The farm's handle on its Redis, as the modules outside worker/state name it: they pass it to
# this layer's functions and never issue a command or import redis themselves (make lint).
Client = redis.Redis


class SettingsHidden(FarmError):
    """Redis answers but refuses to show its settings (CONFIG renamed or disabled: a managed
    Redis). Not a fault of Redis's state: the operator is told what to make sure of."""


def redis_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Translate ``redis.RedisError`` into ``Transient``: the farm's one boundary for Redis.
    Every function of this layer that outside modules call is wrapped in it."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as e:
            raise Transient(f"redis: {type(e).__name__}: {e}") from e
    return wrapper


def client(settings: Settings, socket_timeout_s: float = 30.0,
           connect_timeout_s: float = 5.0) -> Client:
    """The farm's Redis client (never ``redis.Redis`` directly).

    Raises:
        ConfigError: the URL is an open door (``check_auth``).
    """
    check_auth(settings)
    return redis.Redis.from_url(settings.redis_url, socket_timeout=socket_timeout_s,
                                socket_connect_timeout=connect_timeout_s,
                                health_check_interval=30,
                                **(tls_options(settings) or {}))


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, failing as a lost connection once its connection let go of it.

    After losing Redis, Celery collects the connection, then closes it. If a connection error
    stops the channel's first close half-way, ``collect()`` still detaches the transport; the
    second close, handing back unacknowledged messages, then read the detached connection's
    address: ``AttributeError``, "Unrecoverable error", the worker main process gone. Now a
    ``redis.ConnectionError``, which kombu and Celery handle (an ack there too: logged); the
    messages return with the reaper. Test: tests/state/test_broker_channel.py."""

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None:
            raise redis.ConnectionError("this channel's broker connection was closed")
        params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
        return params


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with ``Channel`` (``use_transport``)."""

    Channel = Channel


def use_transport() -> None:
    """Have kombu build ``Transport`` for ``redis://`` and ``rediss://`` URLs in this process.

    Through kombu's registry of URL schemes, so a connection's URL still reads ``redis://``:
    Celery's ``broker_transport`` would make it ``worker.state.broker:Transport://``, which
    Flower's broker page cannot show."""
    for scheme in ("redis", "rediss"):
        kombu_transport.TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
        kombu_transport._transport_cache.pop(scheme, None)  # resolved already: resolve again


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


@redis_errors
def ping(r: Client) -> None:
    """Raises ``Transient`` when Redis does not answer."""
    r.ping()


def answers(settings: Settings, timeout_s: float = 5.0) -> bool:
    """Whether the Redis of ``settings`` answers a PING within ``timeout_s`` (False for a URL
    ``client`` refuses)."""
    try:
        ping(client(settings, socket_timeout_s=timeout_s, connect_timeout_s=min(timeout_s, 1.0)))
    except (Transient, ConfigError, ValueError):
        return False
    return True


@redis_errors
def config(r: Client, names: Iterable[str]) -> dict[str, str]:
    """Redis's settings ``names`` (a name Redis does not know is left out).

    Raises:
        SettingsHidden: Redis refuses CONFIG GET.
        Transient: Redis does not answer.
    """
    found: dict[str, str] = {}
    for name in names:
        try:
            got = r.config_get(name)
        except redis.ResponseError as e:
            raise SettingsHidden(str(e)) from e
        found.update({_text(k): _text(v) for k, v in got.items() if v is not None})
    return found


def _text(x: object) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


@redis_errors
def check_persistence(r: Client, settings: Settings) -> None:
    """Refuse a Redis that keeps nothing on disk, or that drops transactions when it replays
    its AOF (``replay_loss``), unless ``FARM_ALLOW_VOLATILE_REDIS`` is set.

    Raises:
        ConfigError: appendonly is off and volatility was not allowed.
        Transient: Redis does not answer.
    """
    try:
        aof = config(r, ["appendonly"]).get("appendonly", "").lower()
    except SettingsHidden as e:  # CONFIG renamed or disabled (managed Redis)
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


@redis_errors
def replay_loss(r: Client) -> str | None:
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
