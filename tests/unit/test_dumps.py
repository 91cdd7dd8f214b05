"""Dumps: checked at open, values checked while copied; files and maps closed on every path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine_dump.checkpoint import WEIGHTS_SCHEME, served_weights
from engine_dump.dumpfile import (
    ERR_DUMP_DIR_FULL,
    ERR_HOOK_INACTIVE,
    ERR_WRITER_UNHEALTHY,
    M_CONFIG_SHA,
    M_LAYERS,
    M_PATCH_VERSION,
    M_SERVER_VERSION,
    M_WEIGHTS,
    PATCH_VERSION,
    T_AUX,
    T_HIDDEN,
    T_INPUT_IDS,
    T_LOSS_MASK,
    err_path,
)
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from engine_dump.rids import make_rid
from worker.core import checksums, diskio, dumps, finalbytes, tensorfile
from worker.core.errors import Corrupt, ServerMisconfigured
from worker.core.store import OutputStore, Part

H = 1024
LAYERS = (2, 4, 5)


def _fp() -> Fingerprint:
    return Fingerprint("cfg", "tok", "tpl", LAYERS, LAYER_CONVENTION, H, "bfloat16",
                       8192, "reject")


def _rows(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 0x3F00, (n, width), dtype=np.uint16)


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def write_dump(path: Path, ids: list[int], hidden: np.ndarray, aux: np.ndarray,
               **meta: str) -> Path:
    """A dump as the hook writes it (safetensors' save_file, the writer's metadata)."""
    base = {M_LAYERS: json.dumps(list(LAYERS)), M_CONFIG_SHA: "cfg",
            M_PATCH_VERSION: PATCH_VERSION, M_SERVER_VERSION: "test"}
    save_file({T_INPUT_IDS: torch.tensor(ids, dtype=torch.int64), T_HIDDEN: _bf16(hidden),
               T_AUX: _bf16(aux)}, str(path), metadata={**base, **meta})
    return path


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _store(tmp_path: Path) -> OutputStore:
    return OutputStore(tmp_path / "out", _fp()).open()


def _copy(store: OutputStore, d: dumps.Dump, key: str = "k") -> Path:
    """What the worker does with a dump (extract.store_dump, without the read-back)."""
    parts = {name: d.part(name) for name in (T_INPUT_IDS, T_HIDDEN, T_AUX)}
    parts[T_LOSS_MASK] = Part.from_array("I64", np.ones(len(d.ids) // 8, dtype=np.int64))
    return store.write(key, parts, {"content_sha256": "h"}, validate=d.verdict)


def test_a_good_dump_is_copied_and_checksummed_in_one_pass(tmp_path: Path) -> None:
    # Given a dump whose aux tensor spans several mapped windows (3,000 x 3,072 bf16 = 18 MB)
    n = 3000
    ids = [i % 600 for i in range(n)]
    hidden, aux = _rows(n, H, 1), _rows(n, 3 * H, 2)
    path = write_dump(tmp_path / "d.safetensors", ids, hidden, aux)
    assert aux.nbytes > 2 * diskio.MAP_WINDOW_BYTES
    store = _store(tmp_path)
    # When it is opened and copied into a final file
    with dumps.open_dump(path, ids, _fp()) as d:
        final = _copy(store, d)
        part = d.part(T_AUX)
        assert part.shape == (n, 3 * H) and part.source is d.file
    # Then the file holds the exact bytes, with their checksums, and verifies from disk
    sums = checksums.file_checksums(tensorfile.header_metadata(final))[1]
    assert sums[T_AUX] == checksums.tensor_checksum(aux.tobytes())
    assert sums[T_HIDDEN] == checksums.tensor_checksum(hidden.tobytes())
    assert sums[T_INPUT_IDS] == checksums.tensor_checksum(
        np.asarray(ids, dtype=np.int64).tobytes())
    assert store.verify("k", "h").tokens == n
    assert np.array_equal(tensorfile.read(final).tensors[T_AUX].array, aux)
    # And once closed, a part taken from the dump can no longer be copied (no recycled fd)
    with open(tmp_path / "out.bin", "wb") as out, pytest.raises(ValueError, match="closed file"):
        finalbytes.write_parts(out.fileno(), {T_AUX: part}, {})


@pytest.mark.parametrize("where", [0, diskio.MAP_WINDOW_BYTES // 2, -1])
def test_nan_anywhere_is_found_and_counted(tmp_path: Path, where: int) -> None:
    # Given NaN/Inf at the first value, at a window boundary, or at the very last value
    n = 3000
    ids = list(range(n))
    aux = _rows(n, 3 * H, 2)
    flat = aux.reshape(-1)
    flat[where] = 0x7FC0  # NaN
    flat[where - 1 if where else 1] = 0xFF80  # -Inf
    path = write_dump(tmp_path / "d.safetensors", ids, _rows(n, H, 1), aux)
    store = _store(tmp_path)
    before = _open_fds()
    # Then the copy is refused with the exact count, nothing is left on disk, open or mapped
    with dumps.open_dump(path, ids, _fp()) as d, pytest.raises(
            Corrupt, match="aux_hidden_state has 2 NaN/Inf values"):
        _copy(store, d)
    assert _open_fds() == before
    assert str(path) not in Path("/proc/self/maps").read_text()
    assert [p.name for p in (tmp_path / "out").rglob("*") if p.is_file()] == ["manifest.json"]


def test_every_problem_is_reported_and_files_closed(tmp_path: Path) -> None:
    n = 8
    ids = list(range(n))
    good = write_dump(tmp_path / "good.safetensors", ids, _rows(n, H, 1), _rows(n, 3 * H, 2))
    cases = {
        "input_ids differ from those sent (first at position 3)": (good, [*ids[:3], 99, *ids[4:]]),
        "input_ids I64[8], sent 9 tokens": (good, [*ids, 1]),
        "aux_hidden_state is BF16[8, 2048], expected BF16[8, 3072]": (
            write_dump(tmp_path / "shape.safetensors", ids, _rows(n, H, 1), _rows(n, 2 * H, 2)),
            ids),
    }
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(good.read_bytes()[:-10])
    cases["not a valid safetensors file"] = (truncated, ids)
    before = _open_fds()
    for message, (path, sent) in cases.items():
        with pytest.raises(Corrupt) as e:
            dumps.open_dump(path, sent, _fp())
        assert message in str(e.value), str(e.value)
    assert _open_fds() == before


def test_a_dump_of_a_server_with_other_layers_or_config_is_the_servers_fault(
        tmp_path: Path) -> None:
    # Given dumps whose server captures other layers, or runs another model config, with
    # wrong ids too
    n = 8
    ids = list(range(n))
    cases = {
        "server captures layers [1, 2, 3], this run expects": (
            write_dump(tmp_path / "layers.safetensors", ids, _rows(n, H, 1), _rows(n, 3 * H, 2),
                       **{M_LAYERS: "[1, 2, 3]"}), ids),
        "another model is served": (
            write_dump(tmp_path / "cfg.safetensors", ids, _rows(n, H, 1), _rows(n, 3 * H, 2),
                       **{M_CONFIG_SHA: "other"}), [*ids[:3], 99, *ids[4:]]),
    }
    before = _open_fds()
    for message, (path, sent) in cases.items():
        # Then the worker is told its server is set up wrong (it waits, no attempt spent),
        # never that the sample is corrupt, and the fix is named
        with pytest.raises(ServerMisconfigured) as e:
            dumps.open_dump(path, sent, _fp())
        assert message in str(e.value), str(e.value)
    assert "--layers-to-capture" in str(dumps.identity_problems(
        {M_LAYERS: "[1, 2, 3]", M_CONFIG_SHA: _fp().config_sha256}, _fp()))
    assert _open_fds() == before


def test_a_dump_of_other_weights_than_the_runs_is_the_servers_fault(tmp_path: Path) -> None:
    # Given dumps whose server says the weights it serves: the run's, another checkpoint's,
    # and one of an older hook that says nothing
    n, ids = 8, list(range(8))

    def served(weights_id: str) -> str:
        return served_weights({"scheme": WEIGHTS_SCHEME, "id": weights_id,
                               "shards": [{"name": "model.safetensors"}]}, "/models/m")

    def dump(name: str, **meta: str) -> Path:
        return write_dump(tmp_path / f"{name}.safetensors", ids, _rows(n, H, 1),
                          _rows(n, 3 * H, 2), **meta)

    runs, other, old = (dump("runs", **{M_WEIGHTS: served("aaaa")}),
                        dump("other", **{M_WEIGHTS: served("bbbb")}), dump("old"))
    # Then only the other checkpoint's is refused, as the server's fault (the worker pauses,
    # no attempt spent), naming both identities and the fix
    with pytest.raises(ServerMisconfigured) as e:
        dumps.open_dump(other, ids, _fp(), "aaaa")
    assert "serves weights bbbb (loaded from /models/m on its host), the run's are aaaa" \
        in str(e.value) and "restart the server with the run's checkpoint" in str(e.value)
    for path in (runs, old):
        with dumps.open_dump(path, ids, _fp(), "aaaa"):
            pass
    with dumps.open_dump(other, ids, _fp()):  # no run identity: nothing to compare
        pass


@pytest.mark.parametrize(("message", "error"), [
    (f"{ERR_DUMP_DIR_FULL}: 10 bytes free", "NoSpace"),
    (f"{ERR_HOOK_INACTIVE}: SGLang never set the ids", "ServerMisconfigured"),
    (f"{ERR_WRITER_UNHEALTHY}: behind", "ServerMisconfigured"),
    ("gap: chunk starts at 6", "Corrupt"),
])
def test_the_hooks_err_files_tell_the_environment_from_the_request(
        tmp_path: Path, message: str, error: str) -> None:
    # Given the hook's .err for a request
    import asyncio

    rid = make_rid("k", 1, 4)
    err_path(tmp_path, rid).write_text(message + "\n")
    # Then the worker raises what makes it wait (environment) or retry (the request)
    with pytest.raises(Exception) as e:
        asyncio.run(dumps.wait_for_dump(tmp_path, rid, timeout_s=5))
    assert type(e.value).__name__ == error
    assert not err_path(tmp_path, rid).exists()


def test_a_wait_for_a_dump_stops_at_once_when_the_servers_writer_is_unhealthy(
        tmp_path: Path) -> None:
    import asyncio
    import time

    from engine_dump import markers

    # Given a dump dir whose hook process (this one) says its dump writer is unhealthy
    markers.write_unhealthy(tmp_path, "not running: restart the server")
    rid = make_rid("k", 1, 4)
    # When a worker waits for a dump there
    t0 = time.monotonic()
    with pytest.raises(ServerMisconfigured) as e:
        asyncio.run(dumps.wait_for_dump(tmp_path, rid, timeout_s=60))
    # Then it stops within a few seconds, not at its time-out, with the reason: the worker
    # pauses (no attempt spent) instead of failing the sample
    assert time.monotonic() - t0 < 5
    assert f"the server's dump writer is unhealthy (pid {os.getpid()} on " in str(e.value)
    assert "not running: restart the server" in str(e.value)
    assert dumps.writer_problem(tmp_path) == str(e.value)
    markers.clear_unhealthy(tmp_path)
    assert dumps.writer_problem(tmp_path) is None
