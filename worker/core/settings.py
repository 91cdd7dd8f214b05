"""Settings: one frozen dataclass, built from the environment once at start-up, passed down.

Nothing else in the farm reads ``os.environ``. Every setting has a default that works on one
machine; ``Settings.describe()`` lists them (``python -m producer settings``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from engine_dump.engines import Sampling
from worker.core.errors import ConfigError
from worker.core.redis_url import is_tls, masked

_GiB = 1 << 30
_DUMP_DIR = Path("/dev/shm/hsfarm-dumps")
_OUTPUT_DIR = Path("hsfarm-out")


# FARM_DP_ROUTING's values, the rules of worker/server/dp_routing.py
DP_ROUTING_RULES = ("server", "least-tokens", "least-bytes")
# FARM_STORE_DTYPE's values -> the fingerprint's dtype (dumpfile.STORE_DTYPES)
STORE_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp8_e4m3": "fp8_e4m3"}


# FARM_GEN_REASONING's values (worker/regen/record.py) and FARM_GEN_ON_*'s
REASONING_POLICIES = ("keep", "drop", "field")
TURN_POLICIES = ("reject", "keep")


def _doc(default: Any, doc: str) -> Any:
    """A field's default and its one-line meaning (``Settings.reference()``, docs/settings.md)."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Settings:
    """Every knob of the farm. Field name ``x_y`` ↔ environment variable ``FARM_X_Y``."""

    redis_url: str = _doc("redis://127.0.0.1:6379/0",
                          "the broker and the run's index (read from `REDIS_URL`)")
    server_url: str = _doc("http://127.0.0.1:30000", "the inference server on this host")
    dump_dir: Path = _doc(_DUMP_DIR,
                          "where the server's hook writes dumps: the same directory as the "
                          "server's `SGLANG_HS_DUMP_DIR` (vLLM: `HSFARM_VLLM_DUMP_DIR`)")
    output_dir: Path = _doc(_OUTPUT_DIR, "where final files and the manifest go")
    model_path: str = _doc("", "the local model dir, for the tokenizer and the fingerprint "
                           "(empty: ask the server, `/model_info` or vLLM's `/v1/models`)")
    trust_remote_code: bool = _doc(False, "run the tokenizer code shipped with the model "
                                   "(Kimi-K2.5's tiktoken tokenizer needs it)")
    layers_to_capture: tuple[int, ...] = _doc((), "the three aux layers, as on the server "
                                              "(empty: SGLang's default for the model, "
                                              "`[2, L//2, L-3]`)")
    max_tokens: int = _doc(8192, "the longest sample; checked at start against what the server "
                           "takes (`/server_info`)")
    overlong: str = _doc("reject", "`reject` (a shorter server context refuses the start, a "
                         "longer sample is rejected) or `truncate` (cut to `FARM_MAX_TOKENS`)")
    store_dtype: str = _doc("bf16", "hidden states on disk: `bf16` or `fp8_e4m3` (float8 with a "
                            "float32 scale per block of 128 values, docs/fp8.md); "
                            "the server's hook must dump the same (`SGLANG_HS_DUMP_DTYPE`, vLLM: "
                            "`HSFARM_VLLM_DUMP_DTYPE`); part "
                            "of the run's fingerprint")
    queue: str = _doc("", "the Celery queue (empty: the run's own, `hsfarm.<run id>`); runs "
                      "given one name share it, slowly and with a warning")
    max_attempts: int = _doc(5, "attempts of a sample, then it is recorded failed with its "
                             "last error")
    request_timeout_s: float = _doc(600.0, "one request to the server")
    dump_timeout_s: float = _doc(120.0, "how long a worker waits for a request's dump")
    task_time_limit_s: float = _doc(900.0, "one delivery's base time limit, plus its sample's "
                                    "bytes at `FARM_MIN_SAMPLE_BYTES_PER_S` "
                                    "(worker/core/time_limits.py)")
    min_sample_bytes_per_s: float = _doc(50e6, "the floor rate a delivery's limit grows by: "
                                         "2k tokens at H = 7,168 +2 s, 128k +150 s")
    visibility_timeout_s: float = _doc(1200.0, "kombu's last-resort redelivery of a message "
                                       "nobody holds; must exceed the longest delivery's limit "
                                       "+ `FARM_RETRY_BACKOFF_MAX_S`")
    restore_interval_s: float = _doc(10.0, "how often kombu restores unacknowledged messages")
    retry_backoff_s: float = _doc(2.0, "the first retry's backoff (doubling)")
    retry_backoff_max_s: float = _doc(60.0, "the longest retry backoff")
    min_free_output_bytes: int = _doc(2 * _GiB, "the output disk's free space under which "
                                      "workers pause")
    min_free_dump_bytes: int = _doc(256 << 20, "the dump dir's free space under which workers "
                                    "pause")
    pause_poll_s: float = _doc(10.0, "how often a paused task checks whether its cause cleared")
    soft_shutdown_s: float = _doc(30.0, "on SIGTERM: time to finish the tasks in flight")
    janitor_interval_s: float = _doc(30.0, "how often orphaned dumps are swept from the dump dir "
                                     "and parked samples retried")
    max_record_bytes: int = _doc(4 << 20, "a larger record is rejected at enqueue, unread")
    allow_volatile_redis: bool = _doc(False, "accept a Redis that keeps nothing on disk (a "
                                      "restart loses the queue)")
    allow_unauthenticated_redis: bool = _doc(False, "accept a `REDIS_URL` off this machine "
                                             "without a password (a private network you trust)")
    redis_start_wait_s: float = _doc(120.0, "a worker's start: how long it waits for a Redis it "
                                     "has never reached, then exits 2 naming `REDIS_URL` (an "
                                     "outage after that pauses the work instead)")
    redis_ca_file: str = _doc("", "for a `rediss://` URL: the CA that signed Redis's "
                              "certificate (empty: the system's CAs; always verified)")
    redis_cert_file: str = _doc("", "for a `rediss://` URL: this client's certificate, when "
                                "Redis has `tls-auth-clients yes`")
    redis_key_file: str = _doc("", "the key of `FARM_REDIS_CERT_FILE`")
    lease_ttl_s: float = _doc(20.0, "a sample's lease outlives a dead attempt by at most this; "
                              "with the heartbeat's TTL a lost host's samples run elsewhere "
                              "within 30 s")
    heartbeat_ttl_s: float = _doc(20.0, "a worker whose heartbeat is this old is dead")
    reaper_interval_s: float = _doc(5.0, "how often a worker returns dead workers' messages")
    host_id: str = _doc("", "this host's name in a run over several hosts (empty: the "
                        "hostname); set it where hostnames are not unique")
    reconcile_interval_s: float = _doc(60.0, "how often one worker looks for samples in no "
                                       "state (a lost task message, a record Redis lost)")
    reconcile_confirm_s: float = _doc(10.0, "how long a sample must stay in no state before it "
                                      "is published again")
    log_level: str = _doc("INFO", "the workers' log level")
    canary_interval_s: float = _doc(600.0, "how often a host re-checks the canary (also after "
                                    "a server restart or outage)")
    canary_lock_ttl_s: float = _doc(30.0, "one process of a host checks the canary at a time; a "
                                    "lock whose holder died elsewhere is free after this")
    canary_max_rel_err: float = _doc(0.01, "per layer, the canary tokens' largest relative "
                                     "error (docs/canary.md)")
    canary_mean_rel_err: float = _doc(0.0025, "per layer, the canary tokens' mean relative "
                                      "error")
    proof_rate: float = _doc(0.05, "the share of samples proven against the server's own "
                             "prompt logprobs (0: none, 1: every one; docs/proof.md)")
    proof_rows: int = _doc(32, "rows of a proven sample's final state checked, spread over "
                           "the sequence")
    max_in_flight: int = _doc(0, "requests per host at the server at once, all worker processes "
                              "together (0: from `/server_info`)")
    dump_budget_bytes: int = _doc(0, "tmpfs bytes the host's dumps may take until collected "
                                  "(0: in-flight × max tokens × bytes/token, at most half the "
                                  "tmpfs)")
    dp_routing: str = _doc("server", "under DP attention, which group each request goes to: "
                           "`server` (SGLang's choice), `least-tokens` or `least-bytes`")
    regenerate: bool = _doc(False, "regenerate each sample's assistant turns with the served "
                            "model before extracting the regenerated conversation "
                            "(docs/regeneration.md); it and the generation settings below are "
                            "part of the run's fingerprint")
    gen_max_new_tokens: int = _doc(2048, "regeneration: the most tokens of one assistant turn")
    gen_temperature: float = _doc(1.0, "regeneration: sampling temperature (1.0: the model's "
                                  "own distribution; 0: greedy); set the one you serve at")
    gen_top_p: float = _doc(1.0, "regeneration: nucleus sampling's top-p (1.0: off)")
    gen_top_k: int = _doc(-1, "regeneration: top-k (-1: off)")
    gen_stop_token_ids: tuple[int, ...] = _doc((), "regeneration: token ids that end a turn "
                                               "besides the model's end of sequence")
    gen_reasoning: str = _doc("keep", "regeneration, a thinking model's `<think>...</think>`: "
                              "`keep` it in the reply, `drop` it, or `field` (the reply's "
                              "`reasoning_content`, placed by the chat template)")
    gen_on_length: str = _doc("reject", "regeneration, a turn cut at `FARM_GEN_MAX_NEW_TOKENS`: "
                              "`reject` the sample (recorded with the reason) or `keep` the cut "
                              "turn")
    gen_on_empty: str = _doc("reject", "regeneration, an empty reply: `reject` the sample or "
                             "`keep` it")
    gen_max_in_flight: int = _doc(0, "regeneration: generations per host at the server at once "
                                  "(0: the server's `max_running_requests`, else 64)")
    gen_min_tokens_per_s: float = _doc(12.0, "regeneration: the floor decode rate of one "
                                       "request; a turn may take `FARM_GEN_MAX_NEW_TOKENS` at "
                                       "it, and a delivery's time limit grows by one turn")
    debug_write_delay_s: float = _doc(0.0, "crash tests only: a sleep between a final file's "
                                      "temp file and its rename; never set it in production")

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
        if self.dp_routing not in DP_ROUTING_RULES:
            out.append(f"FARM_DP_ROUTING must be one of {', '.join(DP_ROUTING_RULES)}, not "
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
        if not 0.0 <= self.proof_rate <= 1.0 or self.proof_rows < 1:
            out.append("FARM_PROOF_RATE must be within 0..1 and FARM_PROOF_ROWS >= 1, not "
                       f"{self.proof_rate} and {self.proof_rows}")
        if self.dump_timeout_s + 10 > self.task_time_limit_s:
            out.append("FARM_TASK_TIME_LIMIT_S must exceed FARM_DUMP_TIMEOUT_S by 10 s or more")
        out += self._generation_problems()
        tls_files = [f for f in ("redis_ca_file", "redis_cert_file", "redis_key_file")
                     if getattr(self, f)]
        if tls_files and not is_tls(self.redis_url):
            out.append(f"{', '.join(_env_name(f) for f in tls_files)} need a rediss:// REDIS_URL")
        if bool(self.redis_cert_file) != bool(self.redis_key_file):
            out.append("FARM_REDIS_CERT_FILE and FARM_REDIS_KEY_FILE go together")
        return out

    def _generation_problems(self) -> list[str]:
        out = []
        if self.gen_max_new_tokens < 1:
            out.append(f"FARM_GEN_MAX_NEW_TOKENS must be >= 1, not {self.gen_max_new_tokens}")
        if self.gen_temperature < 0:
            out.append(f"FARM_GEN_TEMPERATURE must be >= 0, not {self.gen_temperature}")
        if not 0 < self.gen_top_p <= 1:
            out.append(f"FARM_GEN_TOP_P must be within (0, 1], not {self.gen_top_p}")
        if self.gen_top_k != -1 and self.gen_top_k < 1:
            out.append(f"FARM_GEN_TOP_K must be -1 (off) or >= 1, not {self.gen_top_k}")
        for name, value, allowed in (("FARM_GEN_REASONING", self.gen_reasoning,
                                      REASONING_POLICIES),
                                     ("FARM_GEN_ON_LENGTH", self.gen_on_length, TURN_POLICIES),
                                     ("FARM_GEN_ON_EMPTY", self.gen_on_empty, TURN_POLICIES)):
            if value not in allowed:
                out.append(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        if self.gen_max_in_flight < 0 or self.gen_min_tokens_per_s <= 0:
            out.append("FARM_GEN_MAX_IN_FLIGHT must be >= 0 (0 = auto) and "
                       "FARM_GEN_MIN_TOKENS_PER_S > 0")
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

    @classmethod
    def reference(cls) -> str:
        """Every setting as a Markdown table: variable, default, meaning (docs/settings.md)."""
        rows = ["| variable | default | meaning |", "|---|---|---|"]
        for f in fields(cls):
            rows.append(f"| `{_env_name(f.name)}` | {_shown(f.default)} | {f.metadata['doc']} |")
        return "\n".join(rows) + "\n"

    def describe(self) -> list[str]:
        """``NAME=value`` per setting, the Redis password masked."""
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["redis_url"] = masked(self.redis_url)
        return [f"{_env_name(name)}={value}" for name, value in shown.items()]


def redis_url_given(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment names a Redis (``REDIS_URL``, what ``from_env`` reads), rather
    than leaving ``Settings.redis_url`` at its default."""
    env = os.environ if env is None else env
    return bool(env.get(_env_name("redis_url")))


def _env_name(field_name: str) -> str:
    return "REDIS_URL" if field_name == "redis_url" else f"FARM_{field_name.upper()}"


def _shown(default: object) -> str:
    """A default as the reference table shows it: empty, 0/1 for flags, bytes with their unit."""
    if default in ("", ()):
        return "empty"
    if isinstance(default, bool):
        return f"`{int(default)}`"
    if isinstance(default, int) and default >= 1 << 20:
        unit, div = ("GiB", _GiB) if default >= _GiB else ("MiB", 1 << 20)
        return f"`{default}` ({default / div:g} {unit})"
    return f"`{default}`"


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


GEN_VERSION = 1  # of the generation settings' identity and of the records (worker/regen)


@dataclass(frozen=True)
class GenSettings:
    """The run's generation settings (``FARM_GEN_*``): part of its fingerprint."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...]
    reasoning: str  # keep | drop | field
    on_length: str  # reject | keep
    on_empty: str  # reject | keep

    @classmethod
    def of(cls, s: Settings) -> GenSettings | None:
        """The run's (each field is the setting ``gen_<field>``), or None when it does not
        regenerate."""
        if not s.regenerate:
            return None
        return cls(**{f.name: getattr(s, f"gen_{f.name}") for f in fields(cls)})

    def identity(self) -> str:
        """Canonical JSON: the fingerprint's ``generation`` (any change is another run)."""
        return json.dumps({"version": GEN_VERSION, **asdict(self),
                           "stop_token_ids": list(self.stop_token_ids)},
                          sort_keys=True, separators=(",", ":"))

    def sampling(self, max_new_tokens: int, seed: int | None) -> Sampling:
        return Sampling(max_new_tokens, self.temperature, self.top_p, self.top_k,
                        self.stop_token_ids, seed)


def with_generation(s: Settings, identity: str) -> Settings:
    """``s`` with the generation settings a run's fingerprint records (``identity``; "":
    a run that does not regenerate), whatever the environment says."""
    if not identity:
        return replace(s, regenerate=False)
    said = json.loads(identity)
    values: dict[str, Any] = {
        f"gen_{f.name}": tuple(said[f.name]) if f.name == "stop_token_ids" else said[f.name]
        for f in fields(GenSettings)}
    return replace(s, regenerate=True, **values)


def generation_identity(s: Settings) -> str:
    """The fingerprint's ``generation`` for settings ``s`` ("" when it does not regenerate)."""
    gs = GenSettings.of(s)
    return gs.identity() if gs is not None else ""
