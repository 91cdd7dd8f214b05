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


class OutOfTime(FarmError):
    """The delivery has too little time left for its next step (a regenerated turn): the
    message goes back for a whole delivery, no attempt spent; what was done is kept."""


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


# --- a process's pause while its server does not answer ---------------------------------------
# The reason a paused process records (worker/waits.py, the canary's check); status and the
# dashboard read it back (producer/stall.py) to name the server as what a stalled run waits on.

def server_silent(url: str) -> str:
    """The pause reason of a process whose server does not answer (``SERVER_SILENT`` reads it)."""
    return f"server {url} does not answer (restarting, loading the model, or hung)"


SERVER_SILENT = r"^server \S+ does not answer"


# --- a recorded rejection: the sample's content's, or its environment's ---------------------
# The server side (worker.server.answers, .chat) writes rejections in this wording; enqueue and
# status read it back to publish again what only the environment refused.

# In the reason of a rejection that only the server's short context caused: not the sample's
# content (``environmental_rejection``), so enqueue publishes it again.
SERVER_CONTEXT = "what the server's context takes"

# Messages for an input longer than the server takes: SGLang's (tokenizer manager; scheduler),
# then vLLM 0.32's (renderers/params.py, v1/engine/input_processor.py, serve/utils/api_utils.py).
# The last: a prompt exactly max_model_len long leaves vLLM's get_max_tokens no room for the one
# token the farm asks, and SamplingParams refuses the 0 it gets ("max_tokens must be at least
# 1, got 0. (parameter=max_tokens, value=0)", sampling_params.py)
LENGTH_REFUSALS = ("longer than the model's context length",
                   "exceeds the maximum allowed length",
                   "exceeds the model's maximum context length",
                   "This model's maximum context length is",
                   "longer than the maximum model length",
                   "exceeds model's maximum context length",
                   "max_tokens must be at least 1")


# A rejection recorded in this wording (no code writes it; Redis may hold it) stands for any
# 4xx of the server or of a gateway in front of it: SGLang's own 400s are not told apart.
OLD_REJECTION = "server rejected /generate ("


def environmental_rejection(reason: str) -> bool:
    """Whether a recorded rejection may be the environment's, not the sample's content's, so that
    ``status --check`` and ``enqueue`` put it right.

    True for a length refusal of the server, a cut to the server's context that left no
    assistant tokens, and any rejection in the generic 4xx wording (``OLD_REJECTION``); a
    sample retried again is rejected only for SGLang's own 400, in another wording.
    """
    return (reason.startswith(OLD_REJECTION) or any(m in reason for m in LENGTH_REFUSALS)
            or SERVER_CONTEXT in reason)
