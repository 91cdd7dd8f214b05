"""The live half of ``verify``: one request of ours through a running server, and its dump.

``verify --server URL --dump-dir D`` sends a short request with a valid rid, as a worker would
(SGLang or vLLM: ``engines``), waits for the hook's ``<rid>.safetensors`` in ``D``, checks it
(ids, shapes, dtypes, layers, finite values), removes it and names the weights served. Only
HTTP, the dump dir and safetensors' parser: any python on the host runs it. Under DP
``probe_groups`` pins one request to each group and names every group that fails.
Test: tests/farm/test_dp_groups.py::test_verify_probes_every_group_and_names_the_one_that_fails
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine_dump import dumpdir, engines, header_codec
from engine_dump.dumpfile import (
    AUX_LAYERS,
    M_LAYERS,
    M_WEIGHTS,
    M_WRITER,
    T_AUX,
    T_HIDDEN,
    T_INPUT_IDS,
    dump_path,
    err_path,
)
from engine_dump.engines import Engine, dp_groups
from engine_dump.markers import SharedDumpDir
from engine_dump.rids import make_rid

PROBE_IDS = list(range(10, 26))  # 16 ordinary token ids, valid in any real vocabulary
ANSWER_TIMEOUT_S = 120.0  # for the server's answer (a busy server queues the probe)
_BF16_EXPONENT = 0x7F80  # all exponent bits set: Inf or NaN


class ProbeFailed(Exception):
    """The probe found a problem; the message says what and what to do."""


@dataclass(frozen=True)
class Probe:
    summary: str  # one line: what came back
    metadata: dict[str, str]  # the dump's metadata (versions, layers, the weights served)
    dp_rank: int | None = None  # the DP group it was pinned to (None: not pinned)

    @property
    def weights(self) -> dict[str, Any] | None:
        """What the server says about the weights it serves; None from an older hook."""
        return served_weights(self.metadata)


def served_weights(meta: dict[str, str]) -> dict[str, Any] | None:
    """A dump's ``dumpfile.M_WEIGHTS`` (``checkpoint.served_weights``); None when absent."""
    try:
        served = json.loads(meta.get(M_WEIGHTS, "null"))
    except ValueError:
        return None
    return served if isinstance(served, dict) else None


def run_probe(server_url: str, dump_dir: Path, timeout_s: float = 60.0) -> str:
    """``probe_groups``' one-line summary."""
    return probe_groups(server_url, dump_dir, timeout_s).summary


def probe_groups(server_url: str, dump_dir: Path, timeout_s: float = 60.0) -> Probe:
    """One probe (``probe``) per attention-DP group of the server, each pinned to its group;
    a server without groups gets one unpinned probe. vLLM's groups are its hook's markers':
    those of the server start that wrote an unpinned probe's dump (a dump dir may be shared).
    Returns the first probe, its summary a line for them all.

    Raises:
        ProbeFailed: naming every group whose probe failed, and why.
        dumpdir.DumpDirUnsafe: a dump is a link or another user's file.
    """
    url = server_url.rstrip("/")
    engine = served_engine(url)
    first = None
    info: dict[str, Any] | None
    if engine.name == engines.VLLM:
        first = probe(server_url, dump_dir, timeout_s, engine=engine)
        try:
            info = engine.server_info(dump_dir, first.metadata.get(M_WRITER))
        except SharedDumpDir as e:
            raise ProbeFailed(str(e)) from e
    else:
        info = _get(url, "/server_info")
    groups = dp_groups(info or {})
    if groups <= 1:
        return first or probe(server_url, dump_dir, timeout_s, engine=engine)
    passed, failed = [], []
    for group in range(groups):
        try:
            passed.append(probe(server_url, dump_dir, timeout_s, dp_rank=group, engine=engine))
        except ProbeFailed as e:
            failed.append(f"DP group {group} of {groups}: {e}")
    if failed:
        ok = f" (groups {', '.join(str(p.dp_rank) for p in passed)} passed)" if passed else ""
        raise ProbeFailed("; ".join(failed) + ok)
    pin = engines.VLLM_DP_RANK_HEADER if engine.name == engines.VLLM else "routed_dp_rank"
    return Probe(f"{groups} DP groups, one request pinned to each ({pin}), each dumped by its "
                 f"own group: {passed[0].summary}", passed[0].metadata, passed[0].dp_rank)


def served_engine(url: str) -> Engine:
    """The engine at ``url``, from its answers (as the worker's client finds it).

    Raises:
        ProbeFailed: it does not answer, or answers as neither SGLang nor vLLM.
    """
    info = _get(url, "/model_info", missing_ok=True)
    if info is not None and "model_path" in info:
        return engines.sglang_engine(info)
    models = _get(url, "/v1/models", missing_ok=True)
    version = _get(url, "/version", missing_ok=True) or {}
    engine = engines.vllm_engine(models, str(version.get("version", ""))) if models else None
    if engine is None:
        raise ProbeFailed(f"the server at {url} answers as neither SGLang (/model_info) nor "
                          "vLLM (/v1/models with max_model_len): is this its address?")
    return engine


def probe(server_url: str, dump_dir: Path, timeout_s: float = 60.0,
          dp_rank: int | None = None, engine: Engine | None = None) -> Probe:
    """Probe the server. ``timeout_s``: how long to wait for the dump once the server has
    answered (and at least that long for the answer). ``dp_rank``: pin the request to that
    DP group. ``engine``: the server's, when already asked (``served_engine``).

    Raises:
        ProbeFailed: the server or the hook did not do its part; the message has the fix.
        dumpdir.DumpDirUnsafe: the dump is a link or another user's file.
    """
    url = server_url.rstrip("/")
    engine = engine or served_engine(url)
    hidden = expected_hidden_size({"model_path": engine.model_path})
    group = "" if dp_rank is None else f"g{dp_rank}_"
    rid = make_rid(f"_hsfarm_verify_{group}{os.getpid()}_{int(time.time() * 1000)}", 1,
                   len(PROBE_IDS))
    path_, body, headers = engine.generate(rid, PROBE_IDS, dp_rank)
    t0 = time.monotonic()
    try:
        answer = _post(url, path_, body, headers, max(timeout_s, ANSWER_TIMEOUT_S))
        _check_group(answer, dp_rank)
        path = _wait_for_dump(dump_dir, rid, time.monotonic() + timeout_s,
                              engine.dump_dir_variable)
        tensors, meta = read_safetensors(path)
        layers, shapes = check_dump(tensors, meta, hidden)
    finally:
        for p in (dump_path(dump_dir, rid), err_path(dump_dir, rid)):
            p.unlink(missing_ok=True)
    served = served_weights(meta) or {}
    weights = (f", weights {served.get('id')} ({served.get('shards')} shards)" if served
               else ", weights not said (an older hook)")
    return Probe(f"a {len(PROBE_IDS)}-token request of ours through {url} "
                 f"({engine.describe()}): dump in {dump_dir} "
                 f"after {time.monotonic() - t0:.1f}s, ids equal, {shapes}, layers {layers}, "
                 f"all finite{weights}", meta, dp_rank)


def _check_group(answer: Any, dp_rank: int | None) -> None:
    """SGLang's answer names the DP group that served it (``meta_info.dp_rank``)."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    served = meta.get("dp_rank") if isinstance(meta, dict) else None
    if dp_rank is not None and isinstance(served, int) and served != dp_rank:
        raise ProbeFailed(f"the request pinned to DP group {dp_rank} (routed_dp_rank) was "
                          f"served by group {served}: this server ignores routed_dp_rank")


def expected_hidden_size(model_info: dict[str, Any]) -> int | None:
    """The served model's hidden size from its config.json, when this host can read it."""
    path = Path(str(model_info.get("model_path", ""))) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    inner = cfg.get("text_config")  # multimodal wrappers (Kimi-K2.5)
    cfg = inner if isinstance(inner, dict) and "hidden_size" in inner else cfg
    size = cfg.get("hidden_size")
    return int(size) if isinstance(size, int) else None


def _wait_for_dump(dump_dir: Path, rid: str, deadline: float, variable: str) -> Path:
    dump, err = dump_path(dump_dir, rid), err_path(dump_dir, rid)
    while time.monotonic() < deadline:
        if dump.exists():
            return dump
        if err.exists():
            raise ProbeFailed(f"the hook answered the probe with an error: "
                              f"{err.read_text(errors='replace').strip()}")
        time.sleep(0.05)
    raise ProbeFailed(
        f"the server answered the probe but no dump of it appeared in {dump_dir}: the hook is "
        f"not running in that server ({variable} unset, or hsfarm not installed in the "
        f"server's python), or it writes elsewhere ({variable} must be this directory)")


def check_dump(tensors: dict[str, tuple[str, np.ndarray]], meta: dict[str, str],
               hidden: int | None) -> tuple[list[int], str]:
    """Check one probe dump (``read_safetensors``); returns its layer ids and a shape summary.

    Raises:
        ProbeFailed: with every problem found.
    """
    n = len(PROBE_IDS)
    problems = []
    ids = tensors.get(T_INPUT_IDS)
    if ids is None or ids[0] != "I64" or ids[1].tolist() != PROBE_IDS:
        problems.append("input_ids are not the ids sent")
    h = hidden or (tensors[T_HIDDEN][1].shape[-1] if T_HIDDEN in tensors else 0)
    for name, width in ((T_HIDDEN, h), (T_AUX, AUX_LAYERS * h)):
        got = tensors.get(name)
        if got is None or got[0] != "BF16" or got[1].shape != (n, width):
            shape = f"{got[0]}{list(got[1].shape)}" if got else "missing"
            problems.append(f"{name} is {shape}, expected BF16[{n}, {width}]")
        elif int(np.count_nonzero((got[1] & _BF16_EXPONENT) == _BF16_EXPONENT)):
            problems.append(f"{name} has NaN/Inf values")
    try:
        layers = [int(i) for i in json.loads(meta.get(M_LAYERS, "[]"))]
    except (TypeError, ValueError):
        layers = []
    if len(layers) != AUX_LAYERS:
        problems.append(f"the dump records layers {layers}, expected {AUX_LAYERS} ids")
    if problems:
        raise ProbeFailed(f"the probe's dump is wrong: {'; '.join(problems)}; this hook or "
                          "engine version does not capture what the farm needs")
    return layers, f"hidden BF16[{n}, {h}], aux BF16[{n}, {3 * h}]"


def read_safetensors(path: Path) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """name → (dtype tag, raw array; bf16 as uint16), and the metadata. No torch needed.
    Opened as a worker opens a dump: no link, the dump dir's owner's file (``dumpdir``)."""
    from safetensors import deserialize

    with open(dumpdir.open_trusted(path), "rb") as f:
        data = f.read()
    _, meta = header_codec.decode(data[8 : 8 + header_codec.length(data)])
    raw = {"BF16": "<u2", "I64": "<i8", "F32": "<f4", "I32": "<i4"}
    out = {}
    for name, t in deserialize(data):
        tag = str(t["dtype"])
        arr = np.frombuffer(bytes(t["data"]), dtype=raw.get(tag, "u1"))
        out[name] = (tag, arr.reshape(t["shape"]) if tag in raw else arr)
    return out, meta


def _get(url: str, path: str, missing_ok: bool = False) -> dict[str, Any] | None:
    """``path``'s JSON object; None for a 404 with ``missing_ok`` (another engine's path)."""
    try:
        with urllib.request.urlopen(url + path, timeout=30) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if missing_ok and e.code == 404:
            return None
        raise ProbeFailed(f"the server at {url} answered {path} with {e.code}; is this its "
                          "address?") from e
    except (OSError, ValueError) as e:
        raise ProbeFailed(f"the server at {url} does not answer {path} ({e}); is it up, and "
                          "is this its address?") from e
    if not isinstance(body, dict):
        raise ProbeFailed(f"{url}{path} answered {body!r:.100}: not an SGLang or vLLM server?")
    return body


def _post(url: str, path: str, body: dict[str, Any], headers: dict[str, str],
          timeout_s: float) -> Any:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode("utf-8", "replace")
        raise ProbeFailed(f"the server refused the probe request ({e.code}): {detail}") from e
    except OSError as e:
        raise ProbeFailed(f"the probe request to {url}{path} failed: {e}") from e
    try:
        return json.loads(raw)
    except ValueError:
        return None
