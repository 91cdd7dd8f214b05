"""The rid and the sample key (engine_dump/rids.py), with the names a rid gives files (dump dir,
final path) and the run fingerprint they carry."""

from __future__ import annotations

import pytest

from engine_dump.dumpfile import ERR_SUFFIX, READY_PREFIX, TMP_MARK, rid_of_file
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint, default_layers_to_capture
from engine_dump.rids import (
    INTERNAL_KEY_PREFIX,
    MAX_KEY_LEN,
    MAX_RID_LEN,
    NO_RUN,
    Rid,
    is_user_sample_key,
    is_valid_sample_key,
    make_rid,
    parse_rid,
    sample_key_for,
)
from worker.core import outdir

RUN = "0123456789abcdef"


def test_rid_round_trip() -> None:
    rid = make_rid("ex-0001", 3, 1500, run=RUN)
    assert rid == f"hsd-{RUN}-ex-0001-a3-n1500"
    assert parse_rid(rid) == Rid("ex-0001", 3, 1500, RUN)
    assert parse_rid(make_rid("ex-0001", 3, 1500)) == Rid("ex-0001", 3, 1500, NO_RUN)


def test_rid_with_key_that_looks_like_a_suffix() -> None:
    rid = make_rid("x-a1-n2", 4, 9, run=RUN)
    assert parse_rid(rid) == Rid("x-a1-n2", 4, 9, RUN)


def test_rid_with_key_that_looks_like_a_run() -> None:
    # a key of hex digits and dashes parses the one way: the run has a fixed width
    key = f"{'f' * 16}-{RUN}"
    rid = make_rid(key, 1, 5, run=RUN)
    assert parse_rid(rid) == Rid(key, 1, 5, RUN)


def test_dump_dir_names_say_whose_they_are() -> None:
    rid = make_rid("k", 2, 7, run=RUN)
    want = Rid("k", 2, 7, RUN)
    assert rid_of_file(f"{rid}.safetensors") == want
    assert rid_of_file(f"{rid}.err") == want
    assert rid_of_file(f".{rid}{TMP_MARK}123") == want
    assert rid_of_file(f"{READY_PREFIX}host.1") is None
    assert rid_of_file("hsd-k-a1-n3.safetensors") is None  # a rid without a run


def test_make_rid_refuses_a_run_that_is_no_run_id() -> None:
    for run in ("", "abc", RUN.upper(), RUN + "0", "../../../../etc0"):
        with pytest.raises(ValueError):
            make_rid("k", 1, 3, run=run)


@pytest.mark.parametrize("rid", [
    "HEALTH_CHECK_abc", "warmup", "hsd-", "hsd-key-a1", "hsd-key-a1-nX", "hsd-k/x-a1-n3",
    "hsd-key-a1-n3 ", None, 42, "hsd-key-a1-n3", f"hsd-{RUN}-a1-n3", f"hsd-{RUN[:15]}-k-a1-n3",
    f"hsd-{RUN}-k/x-a1-n3",
])
def test_foreign_rids_are_not_ours(rid: object) -> None:
    assert parse_rid(rid) is None


def test_make_rid_refuses_unsanitised_keys() -> None:
    with pytest.raises(ValueError):
        make_rid("../etc", 1, 3)
    with pytest.raises(ValueError):
        make_rid("ok", 1, 0)


@pytest.mark.parametrize("source_id", [
    "../../etc/passwd", "a/b", "..", ".hidden", "x" * 500, "spaces here", "ünï", "a\\b", 17,
    "", "-lead",
])
def test_sample_keys_are_safe_file_names(source_id: object) -> None:
    key = sample_key_for(source_id, "0" * 32)
    assert is_valid_sample_key(key)
    assert "/" not in key and ".." not in key and not key.startswith(".")
    assert len(key) <= MAX_KEY_LEN


def test_safe_ids_are_kept_and_unsafe_ones_do_not_collide() -> None:
    h = "f00d" * 8
    assert sample_key_for("ex-0001", h) == "ex-0001"
    assert sample_key_for("a/b", h) != sample_key_for("a_b", h)
    assert sample_key_for("a/b", h) != sample_key_for("a\\b", h)
    assert sample_key_for("x" * 500, h) != sample_key_for("x" * 501, h)
    # a record's id never becomes one of the farm's own keys (the canary's, dumped in bf16 in
    # an fp8 run): it is renamed like an unsafe id, and kept
    key = sample_key_for(f"{INTERNAL_KEY_PREFIX}canary", h)
    assert is_user_sample_key(key) and key != f"{INTERNAL_KEY_PREFIX}canary"
    assert sample_key_for(f"{INTERNAL_KEY_PREFIX}canary", h) == key


def test_records_without_id_are_keyed_by_content_not_position() -> None:
    # the same content is the same sample in any file at any position; other content differs
    assert sample_key_for(None, "ab" * 16) == sample_key_for(None, "ab" * 16)
    assert sample_key_for(None, "ab" * 16) != sample_key_for(None, "cd" * 16)
    assert is_valid_sample_key(sample_key_for(None, "ab" * 16))


def test_final_path_is_sharded_inside_the_output_dir(tmp_path) -> None:
    p = outdir.final_path(tmp_path, "ex-0001")
    assert p.parent.parent == tmp_path / "samples"
    assert p.name == "ex-0001.safetensors"
    assert p == outdir.final_path(tmp_path, "ex-0001")


def _fp(**kw: object) -> Fingerprint:
    base: dict[str, object] = dict(
        config_sha256="a", tokenizer_sha256="b", chat_template_sha256="c",
        layers_to_capture=(2, 4, 5), layer_convention=LAYER_CONVENTION, hidden_size=64,
        dtype="bfloat16", max_tokens=8192, overlong="reject")
    base.update(kw)
    return Fingerprint(**base)  # type: ignore[arg-type]


def test_fingerprint_id_is_stable_and_sensitive() -> None:
    assert _fp().id == _fp().id
    assert _fp().id != _fp(layers_to_capture=(2, 4, 6)).id
    assert Fingerprint.from_json(_fp().to_json()) == _fp()
    assert _fp().differences(_fp(hidden_size=7168)) == ["hidden_size: 64 != 7168"]


def test_default_layers_match_sglang() -> None:
    assert default_layers_to_capture(61) == (2, 30, 58)  # Kimi-K2.5 / DeepSeek-V3
    assert default_layers_to_capture(8) == (2, 4, 5)


def test_a_rid_parses_only_if_every_file_name_of_it_fits() -> None:
    # Given the longest rid the farm makes, and rids whose key or numbers are too long for a
    # file name (a 300-character key made the writer's own .err unnameable)
    longest = make_rid("k" * MAX_KEY_LEN, 10**6, 10**9, run=RUN)
    too_long = [f"hsd-{RUN}-{'k' * 300}-a1-n2", f"hsd-{RUN}-{'k' * 97}-a1-n2",
                f"hsd-{RUN}-k-a1-n{'9' * 250}"]
    # Then the first parses and its writer's longest temp name fits NAME_MAX (a 10-digit
    # pid), and the others are not ours: no dump or .err of them is ever attempted
    assert parse_rid(longest) is not None
    assert len(f".{'x' * MAX_RID_LEN}{TMP_MARK}{'9' * 10}{ERR_SUFFIX}") <= 255
    assert [parse_rid(r) for r in too_long] == [None] * 3
    with pytest.raises(ValueError):
        make_rid("k", 1, 10**300)
