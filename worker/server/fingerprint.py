"""Work out the run fingerprint from the settings and the served model's files.

The producer and every worker compute it the same way, so task ids and Redis keys agree. The
model path comes from ``FARM_MODEL_PATH`` or, when empty, from the server's ``/model_info``
(the worker runs on the server's host, so the path is valid there).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint, default_layers_to_capture
from worker.core.errors import ConfigError, Transient
from worker.core.settings import Settings, generation_identity
from worker.server.chat import ChatTokenizer
from worker.server.client import ServerClient

log = logging.getLogger("hsfarm.fingerprint")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "tiktoken.model", "chat_template.jinja", "vocab.json",
                   "merges.txt")


def resolve_model_path(settings: Settings, wait_s: float = 0.0) -> Path:
    """``FARM_MODEL_PATH``, else ask the server, waiting up to ``wait_s`` for it to answer.

    Raises:
        ConfigError: no path set and the server did not answer, or the path has no config.
    """
    if settings.model_path:
        path = Path(settings.model_path)
    else:
        async def ask() -> dict[str, Any]:
            client = ServerClient.of(settings, 30.0)
            t0 = time.monotonic()
            said = -math.inf
            try:
                while True:
                    try:
                        return await client.model_info()
                    except Transient as e:
                        if time.monotonic() > t0 + wait_s:
                            raise
                        if time.monotonic() - said > 30:
                            said = time.monotonic()
                            log.warning("waiting for the server at %s to answer (%.0fs so "
                                        "far; loading the model?): FARM_MODEL_PATH is not "
                                        "set, so the model is asked from it: %s",
                                        settings.server_url, said - t0, e)
                        await asyncio.sleep(1.0)
            finally:
                await client.close()

        try:
            info = asyncio.run(ask())
        except Transient as e:
            raise ConfigError(
                f"cannot ask the server at {settings.server_url} which model it serves ({e}); "
                "start it first or set FARM_MODEL_PATH"
            ) from e
        path = Path(str(info.get("tokenizer_path") or info["model_path"]))
    if not (path / "config.json").is_file():
        raise ConfigError(f"model path {path} has no config.json (set FARM_MODEL_PATH to a "
                          "local copy of the served model's files)")
    return path


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers (Kimi-K2.5) keep the language model's numbers in text_config."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "hidden_size" in inner else config


def chat_template_text(model_path: Path) -> str:
    """The model's chat template as transformers loads it, read from its files without
    transformers: ``chat_template.jinja`` first, else ``tokenizer_config.json``'s entry (a
    list of named templates as sorted JSON); "" when there is none."""
    jinja = model_path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        entry = json.loads((model_path / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return ""
    if isinstance(entry, str):
        return entry
    return json.dumps(entry, sort_keys=True) if entry else ""


def compute_fingerprint(settings: Settings, model_path: Path) -> Fingerprint:
    """From the model's files alone (no tokenizer loaded, no transformers imported): the
    producer and ``status`` start fast and small, and every process computes the same id.

    Raises:
        ConfigError: the model files do not say what is needed.
    """
    config_bytes = (model_path / "config.json").read_bytes()
    try:
        cfg = text_config(json.loads(config_bytes))
        layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{model_path}/config.json lacks num_hidden_layers/hidden_size: {e}"
        ) from e
    tok_hash = hashlib.sha256()
    code = sorted(p.name for p in model_path.glob("tokenization_*.py"))  # remote tokenizer code
    for name in (*TOKENIZER_FILES, *code):
        p = model_path / name
        if p.is_file():
            tok_hash.update(name.encode() + b"\0" + p.read_bytes())
    return Fingerprint(
        config_sha256=hashlib.sha256(config_bytes).hexdigest(),
        tokenizer_sha256=tok_hash.hexdigest(),
        chat_template_sha256=_sha256(chat_template_text(model_path)),
        layers_to_capture=settings.layers_to_capture or default_layers_to_capture(layers),
        layer_convention=LAYER_CONVENTION,
        hidden_size=hidden,
        dtype=settings.hidden_dtype,
        max_tokens=settings.max_tokens,
        overlong=settings.overlong,
        generation=generation_identity(settings),
    )


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def run_fingerprint(settings: Settings, wait_s: float = 0.0) -> tuple[Path, Fingerprint]:
    """The model path and the run's fingerprint, without loading the tokenizer."""
    model_path = resolve_model_path(settings, wait_s=wait_s)
    return model_path, compute_fingerprint(settings, model_path)


def load_run(settings: Settings, wait_s: float = 0.0) -> tuple[Path, ChatTokenizer, Fingerprint]:
    """Model path, tokenizer and fingerprint: what workers (and ``audit``) start from.

    Raises:
        ConfigError: as ``run_fingerprint``, or the tokenizer cannot be used, or it renders
            with another template than its files hold.
    """
    model_path, fp = run_fingerprint(settings, wait_s=wait_s)
    chat = ChatTokenizer.from_pretrained(str(model_path), settings.max_tokens, settings.overlong,
                                         trust_remote_code=settings.trust_remote_code)
    loaded = chat.tok.chat_template
    if isinstance(loaded, str) and _sha256(loaded) != fp.chat_template_sha256:
        raise ConfigError(f"the tokenizer in {model_path} renders with a chat template other "
                          "than its files hold (chat_template.jinja / tokenizer_config.json)")
    return model_path, chat, fp
