"""The farm's errors, a small tree. Third-party exceptions are translated at one boundary.

    FarmError
    ├── ConfigError      bad settings or an output dir of another run; the process stops
    ├── BadInput         the sample itself is wrong; never retried, recorded as rejected
    ├── Transient        timeout, disk full, Redis away; retried with backoff, bounded
    │   ├── ServerUnavailable  cannot connect: the task waits for the server, attempt refunded
    │   └── NoSpace            ENOSPC on the output disk or a full dump dir: wait for space
    └── Corrupt          a dump or file failed a check; retried, then recorded as failed
"""

from __future__ import annotations


class FarmError(Exception):
    """Root of every error the farm raises on purpose."""


class ConfigError(FarmError):
    """Settings, environment or output directory are unusable; fix and restart."""


class BadInput(FarmError):
    """The sample is invalid (format, length, template). Recorded as rejected, never retried."""


class Transient(FarmError):
    """A condition that may pass (server restarting, timeout, low space). Retried with backoff."""


class ServerUnavailable(Transient):
    """The inference server refuses connections (restarting, crashed). Not the sample's fault."""


class NoSpace(Transient):
    """A disk (output) or tmpfs (dumps) ran out of space mid-write. Nothing partial remains."""


class Corrupt(FarmError):
    """A dump or output file failed validation. Retried; recorded as failed when attempts end."""
