"""Settings: one frozen dataclass, built from the environment once at start-up, passed down.

Nothing else in the farm reads ``os.environ``. Every setting has a default that works on one
machine; ``Settings.describe()`` lists them (``python -m producer settings``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from worker.dp_routing import RULES
from worker.errors import ConfigError
from worker.redis_url import is_tls, masked

_GiB = 1 << 30


# FARM_STORE_DTYPE's values -> the fingerprint's dtype (contracts.STORE_DTYPES)
STORE_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp8_e4m3": "fp8_e4m3"}


@dataclass(frozen=True)
class Settings:
    """Every knob of the farm. Field name ``x_y`` ↔ environment variable ``FARM_X_Y``."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    server_url: str = "http://127.0.0.1:30000"
    dump_dir: Path = Path("/dev/shm/hsfarm-dumps")
    output_dir: Path = Path("hsfarm-out")
    model_path: str = ""  # empty: ask the server (/model_info)
    # Run the tokenizer code shipped with the model (Kimi-K2.5's is tiktoken-based remote code)
    trust_remote_code: bool = False
    layers_to_capture: tuple[int, ...] = ()  # empty: SGLang's default for the model
    max_tokens: int = 8192
    overlong: str = "reject"  # or "truncate"
    # Hidden states on disk: "bf16" or "fp8_e4m3" (a scale per token per layer; the server's
    # hook must write the same: SGLANG_HS_DUMP_DTYPE). Part of the run's fingerprint.
    store_dtype: str = "bf16"
    # Empty: the run's own queue, hsfarm.<run id> (worker/run.py). Set it only to name one
    # yourself: two runs given the same name share it (each hands the other's messages back)
    queue: str = ""
    max_attempts: int = 5
    request_timeout_s: float = 600.0
    dump_timeout_s: float = 120.0
    # A delivery's time limit: this, plus its sample's bytes at the floor rate below
    # (worker/time_limits.py: a 64k-token sample gets more time than a 2k one)
    task_time_limit_s: float = 900.0
    min_sample_bytes_per_s: float = 50e6
    visibility_timeout_s: float = 1200.0
    restore_interval_s: float = 10.0
    retry_backoff_s: float = 2.0
    retry_backoff_max_s: float = 60.0
    min_free_output_bytes: int = 2 * _GiB
    min_free_dump_bytes: int = 256 << 20
    pause_poll_s: float = 10.0
    soft_shutdown_s: float = 30.0  # on SIGTERM (REMAP_SIGTERM=SIGQUIT): time to finish tasks
    janitor_interval_s: float = 30.0  # how often orphaned dumps are swept from the dump dir
    max_record_bytes: int = 4 << 20  # a record larger than this is rejected at enqueue
    # A Redis that keeps nothing on disk loses the queue on restart: refused unless allowed
    allow_volatile_redis: bool = False
    # A REDIS_URL off this machine needs a password (worker/broker.py): or this, on a private
    # network that you trust
    allow_unauthenticated_redis: bool = False
    # TLS for a rediss:// REDIS_URL: the CA that signed Redis's certificate (empty: the
    # system's CAs), and this client's certificate and key when Redis checks clients
    redis_ca_file: str = ""
    redis_cert_file: str = ""
    redis_key_file: str = ""
    # A sample's lease outlives a dead attempt by at most this: with the heartbeat's TTL, a
    # lost host's samples run elsewhere within 30 s (heartbeat + reaper interval + 2 s)
    lease_ttl_s: float = 20.0
    heartbeat_ttl_s: float = 20.0  # a worker whose heartbeat is this old is dead
    reaper_interval_s: float = 5.0  # how often a worker returns dead workers' messages
    # This host's name in the run (worker/hosts.py); empty: the hostname. Set it where two
    # hosts share a hostname (containers with host networking, cloned VMs)
    host_id: str = ""
    # The reconciler (worker/reconciler.py): how often one worker looks for samples in no state
    # (a lost task message), and how long a sample must stay so before it is published again
    reconcile_interval_s: float = 60.0
    reconcile_confirm_s: float = 10.0
    log_level: str = "INFO"
    # The canary (worker/canary.py): how often each worker re-checks it, and the tolerance per
    # layer: a token's relative error |new - recorded| / |recorded|, at most this (max over
    # tokens) and on average this (mean). Margins measured in docs/canary.md.
    canary_interval_s: float = 600.0
    # One process of a host checks the canary at a time; a lock whose holder died elsewhere
    # (another machine or pid namespace) is free after this (on this machine: at once)
    canary_lock_ttl_s: float = 30.0
    canary_max_rel_err: float = 0.01
    canary_mean_rel_err: float = 0.0025
    # Host-wide admission (worker/admission.py), 0 = sized from the server and tmpfs: requests
    # in flight to the server at once, and tmpfs bytes their dumps may take until collected.
    max_in_flight: int = 0
    dump_budget_bytes: int = 0
    # Under DP attention, which group each request goes to (worker/dp_routing.py)
    dp_routing: str = "server"
    # Fault injection for the crash tests only: sleep between writing a final file's temp file
    # and its rename, so a test can kill a process mid-copy. Never set it in production.
    debug_write_delay_s: float = 0.0

    @property
    def hidden_dtype(self) -> str:
        """The storage dtype as the fingerprint and the dumps name it."""
        return STORE_DTYPE_NAMES[self.store_dtype]

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ConfigError("invalid settings: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        out = []
        if self.overlong not in ("reject", "truncate"):
            out.append(f"FARM_OVERLONG must be 'reject' or 'truncate', not {self.overlong!r}")
        if self.dp_routing not in RULES:
            out.append(f"FARM_DP_ROUTING must be one of {', '.join(RULES)}, not "
                       f"{self.dp_routing!r}")
        if self.store_dtype not in STORE_DTYPE_NAMES:
            out.append(f"FARM_STORE_DTYPE must be 'bf16' or 'fp8_e4m3', not {self.store_dtype!r}")
        if self.max_tokens < 2:
            out.append(f"FARM_MAX_TOKENS must be >= 2, not {self.max_tokens}")
        if self.max_attempts < 1:
            out.append(f"FARM_MAX_ATTEMPTS must be >= 1, not {self.max_attempts}")
        if self.layers_to_capture and len(self.layers_to_capture) != 3:
            out.append(f"FARM_LAYERS_TO_CAPTURE needs 3 ids, got {list(self.layers_to_capture)}")
        # A message must never outlive its visibility timeout while it runs (it would be
        # delivered twice), nor while it waits for a retry countdown.
        if self.task_time_limit_s + self.retry_backoff_max_s >= self.visibility_timeout_s:
            out.append(
                "FARM_VISIBILITY_TIMEOUT_S must exceed FARM_TASK_TIME_LIMIT_S + "
                f"FARM_RETRY_BACKOFF_MAX_S ({self.visibility_timeout_s} <= "
                f"{self.task_time_limit_s} + {self.retry_backoff_max_s})"
            )
        if self.min_sample_bytes_per_s <= 0:
            out.append("FARM_MIN_SAMPLE_BYTES_PER_S must be > 0, not "
                       f"{self.min_sample_bytes_per_s}")
        if self.max_in_flight < 0 or self.dump_budget_bytes < 0:
            out.append("FARM_MAX_IN_FLIGHT and FARM_DUMP_BUDGET_BYTES must be >= 0 (0 = auto)")
        if self.heartbeat_ttl_s < 2 * self.reaper_interval_s:
            out.append("FARM_HEARTBEAT_TTL_S must be at least twice FARM_REAPER_INTERVAL_S")
        if self.reconcile_interval_s <= 0 or self.reconcile_confirm_s < 1:
            out.append("FARM_RECONCILE_INTERVAL_S must be > 0 and FARM_RECONCILE_CONFIRM_S "
                       ">= 1 (a delivery in flight needs that long to show in the broker)")
        if self.lease_ttl_s < 3:
            out.append(f"FARM_LEASE_TTL_S must be >= 3, not {self.lease_ttl_s}")
        if self.max_record_bytes < 1024:
            out.append(f"FARM_MAX_RECORD_BYTES must be >= 1024, not {self.max_record_bytes}")
        if self.canary_interval_s <= 0:
            out.append(f"FARM_CANARY_INTERVAL_S must be > 0, not {self.canary_interval_s}")
        if self.canary_lock_ttl_s < 3:
            out.append(f"FARM_CANARY_LOCK_TTL_S must be >= 3, not {self.canary_lock_ttl_s}")
        if not 0 < self.canary_mean_rel_err <= self.canary_max_rel_err:
            out.append("FARM_CANARY_MEAN_REL_ERR must be > 0 and at most FARM_CANARY_MAX_REL_ERR")
        if self.dump_timeout_s + 10 > self.task_time_limit_s:
            out.append("FARM_TASK_TIME_LIMIT_S must exceed FARM_DUMP_TIMEOUT_S by 10 s or more")
        tls_files = [f for f in ("redis_ca_file", "redis_cert_file", "redis_key_file")
                     if getattr(self, f)]
        if tls_files and not is_tls(self.redis_url):
            out.append(f"{', '.join(_env_name(f) for f in tls_files)} need a rediss:// REDIS_URL")
        if bool(self.redis_cert_file) != bool(self.redis_key_file):
            out.append("FARM_REDIS_CERT_FILE and FARM_REDIS_KEY_FILE go together")
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Build from ``FARM_*`` variables (and ``REDIS_URL``).

        Raises:
            ConfigError: a value does not parse, or the combination is invalid.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = _env_name(f.name)
            raw = env.get(name)
            if raw is None and f.name == "redis_url":
                raw = env.get("REDIS_URL")
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = _parse(getattr(cls, f.name), raw)
            except ValueError as e:
                raise ConfigError(f"{name}={raw!r}: {e}") from e
        return cls(**values)

    def describe(self) -> list[str]:
        """``NAME=value`` per setting, the Redis password masked."""
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["redis_url"] = masked(self.redis_url)
        return [f"{_env_name(name)}={value}" for name, value in shown.items()]


def redis_url_given(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment names a Redis (``REDIS_URL`` or ``FARM_REDIS_URL``), rather
    than leaving ``Settings.redis_url`` at its default."""
    env = os.environ if env is None else env
    return bool(env.get("FARM_REDIS_URL") or env.get("REDIS_URL"))


def _env_name(field_name: str) -> str:
    return "REDIS_URL" if field_name == "redis_url" else f"FARM_{field_name.upper()}"


def _int_list(raw: str) -> tuple[int, ...]:
    return tuple(int(x) for x in raw.replace(",", " ").split())


def _parse(default: object, raw: str) -> Any:
    """Parse ``raw`` into the type of the field's default."""
    parsers: list[tuple[type, Callable[[str], Any]]] = [
        (bool, lambda s: s.lower() in ("1", "true", "yes", "on")),
        (int, lambda s: int(float(s)) if "e" in s.lower() else int(s)),
        (float, float),
        (Path, Path),
        (tuple, _int_list),
        (str, str),
    ]
    for kind, parse in parsers:
        if isinstance(default, kind):
            return parse(raw)
    raise ValueError(f"no parser for {type(default).__name__}")
