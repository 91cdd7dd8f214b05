"""What a ``REDIS_URL`` says about who may connect, and how to show it without its password.

Pure functions on the URL text, used by the settings (to print them) and by ``broker`` (to
refuse an open door). No name is resolved: only a literal loopback address, ``localhost`` or
a unix socket counts as local, since what a name resolves to can change under the farm.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import parse_qs, urlsplit

LOCAL_SCHEMES = ("unix", "socket")
TLS_SCHEME = "rediss"
MASK = "***"
_QUERY_PASSWORD = re.compile(r"(?i)([?&]password=)[^&]*")
_QUERY_MASKED = r"\g<1>" + MASK


def masked(url: str) -> str:
    """``url`` with its password (in the userinfo or the query) replaced by ``***``."""
    url = _QUERY_PASSWORD.sub(_QUERY_MASKED, url)
    scheme, sep, rest = url.partition("://")
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    userinfo, at, hostport = rest[:end].rpartition("@")
    user, colon, password = userinfo.partition(":")
    if not (sep and at and colon and password):
        return url
    return f"{scheme}://{user}:{MASK}@{hostport}{rest[end:]}"


def is_local(url: str) -> bool:
    """A unix socket, ``localhost`` or a loopback address (127.0.0.0/8, ::1); no host: local."""
    parts = urlsplit(url)
    if parts.scheme in LOCAL_SCHEMES:
        return True
    host = (parts.hostname or "").lower()
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: not resolved, not local
        return False


def has_password(url: str) -> bool:
    """A password in the userinfo (``redis://[user]:pw@``) or the query (``?password=``)."""
    parts = urlsplit(url)
    return bool(parts.password) or any(parse_qs(parts.query).get("password", []))


def is_tls(url: str) -> bool:
    return urlsplit(url).scheme == TLS_SCHEME
