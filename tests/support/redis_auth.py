"""A Redis URL that names a user and no password: the open door both redis_auth halves refuse."""

from __future__ import annotations

OPEN_DOOR = "redis://alice@192.0.2.1:6379/0"  # TEST-NET-1; a user, no password
