"""Which Redis URLs need a password: loopback and unix sockets do not, any other host does
(a user without a password is still an open door), and the password is masked wherever the
URL is shown. Settings only; no Redis.
"""

from __future__ import annotations

from tests.support.redis_auth import OPEN_DOOR
from worker.core.errors import ConfigError
from worker.core.settings import Settings
from worker.state import broker

# The default user stays on, with a password of its own: with it off, Redis 7.0 drops every
# MULTI/EXEC from its AOF on restart (broker.replay_loss)


def _check(url: str, **env: str) -> str | None:
    try:
        broker.check_auth(Settings.from_env({"REDIS_URL": url, **env}))
    except ConfigError as e:
        return str(e)
    return None


def test_which_urls_need_a_password() -> None:
    # Loopback and unix sockets: no password needed
    for url in ("redis://127.0.0.1:6379/0", "redis://127.8.0.3/0", "redis://localhost:1/0",
                "redis://[::1]:6379/0", "unix:///run/redis.sock", "redis:///0"):
        assert _check(url) is None, url
    # Anything else: a password (userinfo or query), or the explicit opt-out
    assert _check("redis://:pw@10.1.2.3:6379/0") is None
    assert _check("rediss://alice:pw@redis.example:6380/0") is None
    assert _check("redis://10.1.2.3/0?password=pw") is None
    assert _check("redis://10.1.2.3/0", FARM_ALLOW_UNAUTHENTICATED_REDIS="1") is None
    for url in ("redis://10.1.2.3:6379/0", "rediss://redis.example/0", OPEN_DOOR,
                "redis://[fe80::1]:6379/0"):
        why = _check(url)
        assert why is not None and "FARM_ALLOW_UNAUTHENTICATED_REDIS" in why, url
    # And the password is masked wherever the URL is shown
    s = Settings(redis_url="rediss://alice:s3cr3t@10.1.2.3:6380/0?password=s3cr3t")
    assert "s3cr3t" not in broker.where(s) and "alice" in broker.where(s)
    assert not any("s3cr3t" in line for line in s.describe())
