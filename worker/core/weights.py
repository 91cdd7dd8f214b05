"""The weights identity on the farm's side: computed from ``FARM_MODEL_PATH``, compared with the
run's recording and with what the server says it serves.

The algorithm (every data byte of each shard, hashed once and cached) lives in
``engine_dump.checkpoint``: both hooks and the reference server compute the same identity from
the files they loaded and publish it (``dumpfile.M_WEIGHTS``). A run recorded by an older
hsfarm (``shards-v1``: sampled ranges only) is compared on the fields it recorded; the canary
(``canary.py``) compares what the server computes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine_dump import checkpoint
from worker.core.errors import ConfigError

log = logging.getLogger("hsfarm.weights")

SCHEME = checkpoint.WEIGHTS_SCHEME
SAMPLES = checkpoint.WEIGHTS_SAMPLES
SAMPLE_BYTES = checkpoint.WEIGHTS_SAMPLE_BYTES
WORKER_REFUSES = "This worker takes no work."  # what a worker does while its server is wrong
sample_offsets = checkpoint.sample_offsets
# what a run recorded under the older scheme cannot be checked for, in a log line
V1_BLIND = (f"its identity (scheme {checkpoint.WEIGHTS_SCHEME_V1}, recorded by an older hsfarm) "
            "hashes only sampled ranges of each shard: a change between them (one embedding row) "
            "is not seen here, only by the canary; a new run records every byte")


def weights_identity(model_path: Path) -> dict[str, Any]:
    """The identity of the checkpoint in ``model_path``: every ``*.safetensors`` shard.

    A model dir without safetensors shards (a synthetic model, weights in another format)
    has an empty list of shards: nothing to compare but the canary, which the log says.

    Raises:
        ConfigError: a shard is not whole.
    """
    try:
        identity = checkpoint.weights_identity(model_path)
    except checkpoint.WeightsUnreadable as e:
        raise ConfigError(str(e)) from e
    except OSError as e:
        raise ConfigError(f"the weights in {model_path} cannot be read ({e}); make them "
                          "readable by this worker, or set FARM_MODEL_PATH") from e
    except ImportError as e:
        raise ConfigError(str(e)) from e
    if not identity["shards"]:
        log.warning("no *.safetensors weight files in %s: the weights cannot be identified "
                    "(only the canary guards them)", model_path)
    return identity


def incomparable(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why the two identities cannot be compared (then only the canary can tell), or None.

    A host whose model dir holds only the config and tokenizer (the weights live where the
    server runs), a run recorded on such a host, or an identity of another scheme (another
    hsfarm version) says nothing about the weights: refusing the run for it would stop a
    healthy farm.
    """
    if _fields(recorded, current) is None:
        return (f"the run recorded identity scheme {recorded.get('scheme')!r}, this hsfarm "
                f"computes {current.get('scheme')!r}")
    if not current.get("shards"):
        return "this host's model dir has no *.safetensors weight files"
    if not recorded.get("shards"):
        return "the run was recorded from a model dir without *.safetensors weight files"
    return None


def _fields(recorded: dict[str, Any], current: dict[str, Any]) -> tuple[str, ...] | None:
    """The shard fields the two identities can be compared on: all of the recorded scheme's
    when the current one has them (an older scheme's are a subset); None if none."""
    fields = checkpoint.WEIGHTS_SCHEME_FIELDS.get(str(recorded.get("scheme")))
    have = checkpoint.WEIGHTS_SCHEME_FIELDS.get(str(current.get("scheme")), ())
    return fields if fields and set(fields) <= set(have) else None


def older_scheme(recorded: dict[str, Any]) -> bool:
    """The run recorded its identity under ``shards-v1``: compared, but blind between samples."""
    return recorded.get("scheme") == checkpoint.WEIGHTS_SCHEME_V1 != SCHEME


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two identities, shard by shard, in words (empty: the same).

    An identity of the older scheme is compared on the fields it recorded."""
    fields = _fields(recorded, current)
    if fields is None:
        return [f"identity scheme {recorded.get('scheme')!r} != {current.get('scheme')!r}"]
    mine = {s["name"]: s for s in recorded.get("shards", [])}
    now = {s["name"]: s for s in current.get("shards", [])}
    out = [f"{n}: missing now" for n in sorted(set(mine) - set(now))]
    out += [f"{n}: not in the recorded checkpoint" for n in sorted(set(now) - set(mine))]
    for name in sorted(set(mine) & set(now)):
        a, b = mine[name], now[name]
        what = [k for k in fields if a.get(k) != b.get(k)]
        if "sampled_sha256" in what and "data_xxh3_128" in what:
            what.remove("data_xxh3_128")  # the sampled ranges are data: implied
        if "size" in what:
            out.append(f"{name}: size {a.get('size')} != {b.get('size')}")
        elif what:
            out.append(f"{name}: {' and '.join(_WORDS[k] for k in what)} bytes differ")
    return out


_WORDS = {"header_sha256": "header", "sampled_sha256": "sampled", "data_xxh3_128": "data"}


def mismatch(recorded: dict[str, Any], current: dict[str, Any], model_path: Path) -> str | None:
    """Why ``current`` is not the ``recorded`` checkpoint, with the two ways on; None if it is."""
    diff = differences(recorded, current)
    if not diff:
        return None
    shown = "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
    if older_scheme(recorded):
        shown += f" (compared on the run's identity scheme {checkpoint.WEIGHTS_SCHEME_V1})"
    return (f"the weights in {model_path} are not the checkpoint this run's hidden states came "
            f"from (weights identity {current.get('id')} != recorded {recorded.get('id')}): "
            f"{shown}. Restore the original checkpoint (and serve it), or start a new "
            "FARM_OUTPUT_DIR for the new one.")


def served_mismatch(served: dict[str, Any] | None, recorded: dict[str, Any] | None,
                    local: dict[str, Any] | None, *, server_url: str, model_path: Path,
                    manifest: Path, started: bool, refusing: str = WORKER_REFUSES) -> str | None:
    """Why the server must be refused: the weights it serves (``served``: what its dumps and
    ready marker say, ``checkpoint.served_weights``) are not the run's (``recorded``) or those in
    FARM_MODEL_PATH (``local``); None when they are, or when nothing can be compared (logged).

    ``started``: hidden states of the run exist (its canary is recorded). Before that, either
    side may be the wrong one; after, the run's checkpoint is the right one. ``refusing``:
    what the caller does meanwhile (one sentence).
    """
    if not served or not served.get("id"):
        log.warning("the server at %s does not say which weights it serves (its hsfarm hook is "
                    "older than this worker): only the canary guards the served model", server_url)
        return None
    if served.get("scheme") != SCHEME or not served.get("shards"):
        log.warning("the weights the server at %s serves cannot be compared here (identity "
                    "scheme %s, %s shards, from %s): only the canary guards them", server_url,
                    served.get("scheme"), served.get("shards"), served.get("model_path"))
        return None
    run = recorded if recorded and recorded.get("shards") and recorded.get("scheme") == SCHEME \
        else None
    mine = local if local and local.get("shards") and local.get("scheme") == SCHEME else None
    sid = served["id"]
    if (run is None or run["id"] == sid) and (mine is None or mine["id"] == sid):
        if run is not None or mine is not None:
            log.info("the server at %s serves weights %s: the run's", server_url, sid)
        return None
    head = (f"the server at {server_url} serves weights {sid} (loaded from "
            f"{served.get('model_path')} on its host), ")
    if run is not None and run["id"] != sid and started:
        holds = f", as FARM_MODEL_PATH={model_path} holds" if mine is not None else ""
        return (head + f"but the run's weights are {run['id']}{holds}: its hidden states must "
                f"not be mixed with another checkpoint's. {refusing} Fix the server: restart "
                "the server with the run's checkpoint (the same revision as "
                f"FARM_MODEL_PATH); or, to keep the server's checkpoint, start a new run for it "
                "(a new FARM_OUTPUT_DIR, with FARM_MODEL_PATH holding that checkpoint on every "
                "worker host).")
    ours = mine or run
    assert ours is not None
    fix = ("copy the server's checkpoint into FARM_MODEL_PATH" + (
        f" and remove {manifest} (it records the other weights; no hidden states were written "
        "under it yet)" if manifest.exists() else "") if not started
           else "point FARM_MODEL_PATH at the server's checkpoint")
    return (head + f"FARM_MODEL_PATH={model_path} holds {ours['id']}: the server and the "
            f"workers must have one checkpoint (the same revision on both hosts). {refusing} "
            "Change the side that is wrong: serve the checkpoint of "
            f"FARM_MODEL_PATH (restart the server with it), or {fix}.")


def dump_mismatch(served_json: str | None, run_weights_id: str) -> str | None:
    """Why one dump must not reach a final file: the weights its server says it serves (the
    dump's ``dumpfile.M_WEIGHTS``) are not the run's (``run_weights_id``), with the fix; None
    when they are, or when nothing can be compared (an older hook, another scheme, no run id:
    the canary guards those)."""
    try:
        served = json.loads(served_json or "null")
    except ValueError:
        served = None
    if not run_weights_id or not isinstance(served, dict) or not served.get("id") \
            or served.get("scheme") != SCHEME or not served.get("shards"):
        return None
    if served["id"] == run_weights_id:
        return None
    return (f"its server serves weights {served['id']} (loaded from {served.get('model_path')} "
            f"on its host), the run's are {run_weights_id}: no hidden state of another "
            "checkpoint is written. This worker pauses, spending no attempt; restart the "
            "server with the run's checkpoint (the same revision as FARM_MODEL_PATH), or start "
            "a new run (a new FARM_OUTPUT_DIR) for the server's")
