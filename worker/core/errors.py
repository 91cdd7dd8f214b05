"""The farm's errors, a small tree (drawn below). Third-party exceptions are translated at one
boundary. The environment's faults (ConfigError and the waits) never count against a sample.
Test: tests/farm/test_env_faults.py::test_gateway_refusals_spend_no_attempts.
"""

# FarmError
# ├── ConfigError        bad settings, a missing library, an output dir of another run;
# │                      the process stops (before consuming, or handing its message back)
# ├── BadInput           the sample itself is wrong; never retried, recorded as rejected
# ├── MalformedMessage   a task message no producer of this run wrote; refused and logged
# ├── StaleRecord        the record changed after enqueue; no outcome, re-run enqueue
# ├── RecordRemoved      the message's sample left the run (removed from the corpus)
# ├── KeyTaken           the sample's file holds another record; recorded as failed at once
# ├── Transient          timeout, server error, Redis away; retried with backoff, bounded
# │   ├── ServerUnavailable    the server does not answer: wait for it, attempt refunded
# │   │   ├── ServerMisconfigured  it answers but its dump hook is not active: wait
# │   │   └── ServerBusy           it (or a gateway) refuses for now: 429, 502-504...
# │   ├── NoSpace              ENOSPC/EDQUOT or a full dump dir: wait for space, refunded
# │   ├── OutputUnavailable    the output disk refuses writes (EROFS, EIO...): wait, refunded
# │   └── DataFileUnavailable  the data file cannot be read: its samples park, refunded
# └── Corrupt            a dump or file failed a check; retried, then recorded as failed
#     └── NotAsHashed    bytes copied into a file are not the ones its writer hashed earlier

from __future__ import annotations


class FarmError(Exception):
    """Root of every error the farm raises on purpose."""


class ConfigError(FarmError):
    """Settings, environment or output directory are unusable; fix and restart."""


class BadInput(FarmError):
    """The sample is invalid (format, length, template). Recorded as rejected, never retried."""


class SourceFileRefused(FarmError):
    """A file offered to ``adopt`` cannot be taken (unreadable, unsafe, wrong shapes, bad
    values); it is reported with the reason and the other files go on."""


class MalformedMessage(FarmError):
    """A task message that fails validation (crafted, corrupted, or for another run)."""


class StaleRecord(FarmError):
    """The record a message points at is no longer in its data file as it was enqueued."""


class RecordRemoved(FarmError):
    """The sample a message names is no longer in the run: ``enqueue`` saw its record removed
    from its data file or replaced by a corrected one. The message is acknowledged."""


class KeyTaken(FarmError):
    """The sample key's final file holds another record (another data file, another run).

    Never deleted, never overwritten: the sample is recorded as failed with the reason.
    """


class Transient(FarmError):
    """A condition that may pass (server restarting, timeout, low space). Retried with backoff."""


class ServerUnavailable(Transient):
    """The inference server refuses connections or does not answer. Not the sample's fault."""


class ServerMisconfigured(ServerUnavailable):
    """The server answers, but its dump hook cannot dump (not loaded, no capture ids)."""


class ServerBusy(ServerUnavailable):
    """The server, or a gateway in front of it, refuses the request for now (a rate limiter's
    429, a load balancer's 502-504, a proxy's error page): nothing about the sample.

    Args:
        status: the HTTP status of the answer.
    """

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class OutputUnavailable(Transient):
    """The output disk refuses I/O (read-only, I/O error, stale NFS handle, permissions):
    nothing about the sample. Nothing partial remains."""


class LeaseLost(Transient):
    """This attempt's sample lease expired or was taken over: it must not write anything
    (``worker/state/lease.py``; here so that the store, which runs without Redis, can raise it)."""


class NoSpace(Transient):
    """A disk (output) or tmpfs (dumps) ran out of space mid-write. Nothing partial remains.

    Args:
        need_bytes: what the write needed, when known (a wait for space waits for this much).
        on_server: the server's hook found the dump dir full (by its own reserve, which this
            worker cannot see: the wait then holds at least one poll interval).
        never_fits: the write is larger than its whole file system: no wait helps; the
            message says what to change.
    """

    def __init__(self, message: str, need_bytes: int = 0, on_server: bool = False,
                 never_fits: bool = False) -> None:
        super().__init__(message)
        self.need_bytes = need_bytes
        self.on_server = on_server
        self.never_fits = never_fits


class DataFileUnavailable(Transient):
    """The data file cannot be opened or read (unmounted, moved, permissions): its samples
    are parked (worker/state/corpus.py) until it can be read or is enqueued from its new path."""


class Corrupt(FarmError):
    """A dump or output file failed validation. Retried; recorded as failed when attempts end."""


class NotAsHashed(Corrupt):
    """Bytes copied into a final file are not the ones the writer hashed before (``adopt``: the
    source file changed after its check); the file is abandoned before its rename."""
