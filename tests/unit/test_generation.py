"""A regenerating run's pieces without a server: which turns it answers, a turn from an engine's
answer, the policies, the durable record, the settings and the fingerprint."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from engine_dump.engines import FINISH_LENGTH, FINISH_STOP, Decoded
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from worker.core import time_limits
from worker.core.errors import ConfigError, Corrupt, OutOfTime
from worker.core.settings import GenSettings, Settings, generation_identity, with_generation
from worker.regen import record as gen
from worker.regen import step
from worker.server.admission import DEFAULT_GEN_IN_FLIGHT, MAX_SLOTS, generation_limits

SYS = {"role": "system", "content": "Be brief."}
U1, U2 = {"role": "user", "content": "Hi"}, {"role": "user", "content": "And then?"}
A1, A2 = {"role": "assistant", "content": "Hello."}, {"role": "assistant", "content": "Then."}
TOOL = {"role": "tool", "content": "42"}
GS = GenSettings(64, 0.7, 0.9, 20, (7,), "keep", "reject", "reject")
# token id -> text, for a tokenizer's decode without one
VOCAB = {1: "<think>", 2: "plan", 3: "</think>", 4: "\n\n", 5: "Answer", 6: ".", 9: "<eos>"}


def _decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


@pytest.mark.parametrize(("messages", "positions"), [
    ([SYS, U1, A1, U2, A2], [2, 4]),  # each assistant turn after a user turn
    ([U1], [1]),  # a conversation ending with the user's: the reply is appended
    ([U1, A1, U2], [1, 3]),
    ([A1, U1, A2], [2]),  # the assistant's opening greeting is kept
    ([U1, U2, A1], [2]),  # two user turns in a row: one reply, after the second
    ([U1, A1, TOOL, A2], [1]),  # a reply to a tool's output is kept
    ([SYS, A1], []),
])
def test_which_turns_are_regenerated(messages: list[dict[str, str]],
                                     positions: list[int]) -> None:
    assert gen.reply_positions(messages) == positions


@pytest.mark.parametrize(("policy", "content", "message_keys"), [
    ("keep", "<think>plan</think>\n\nAnswer.", {"role", "content"}),
    ("drop", "Answer.", {"role", "content"}),
    ("field", "Answer.", {"role", "content", "reasoning_content"}),
])
def test_a_thinking_reply_is_split_at_its_think_tag_per_the_policy(
        policy: str, content: str, message_keys: set[str]) -> None:
    out = Decoded([1, 2, 3, 4, 5, 6, 9], FINISH_STOP, 9, 11)
    turn = gen.make_turn(3, 11, out, seed=5, reasoning_policy=policy, end_ids=frozenset({9}),
                         decode=_decode)
    assert turn.output_ids == [1, 2, 3, 4, 5, 6, 9]  # as the engine said, the EOS included
    assert (turn.content, turn.reasoning) == (content, "plan")
    msg = turn.message(policy)
    assert set(msg) == message_keys and msg["content"] == content
    if policy == "field":
        assert msg["reasoning_content"] == "plan"


def test_a_turn_cut_at_length_keeps_its_last_token_and_is_rejected_unless_kept() -> None:
    cut = gen.make_turn(1, 4, Decoded([5, 6, 9], FINISH_LENGTH, None, 4), 1, "keep",
                        frozenset({9}), _decode)
    assert cut.content == "Answer.<eos>"  # a cut turn's last token is text, not its end
    problem = gen.policy_problem(GS, cut, 0)
    assert problem is not None and "cut at 3 tokens" in problem
    assert "FARM_GEN_ON_LENGTH=keep" in problem
    assert gen.policy_problem(replace(GS, on_length="keep"), cut, 0) is None
    empty = gen.make_turn(1, 4, Decoded([9], FINISH_STOP, 9, 4), 1, "keep", frozenset({9}),
                          _decode)
    assert empty.content == ""
    assert "empty reply" in (gen.policy_problem(GS, empty, 1) or "")
    assert gen.policy_problem(replace(GS, on_empty="keep"), empty, 1) is None
    # a reply that is all reasoning is empty once the reasoning is dropped
    thought = gen.make_turn(1, 4, Decoded([1, 2, 3, 9], FINISH_STOP, 9, 4), 1, "drop",
                            frozenset({9}), _decode)
    assert thought.content == "" and gen.policy_problem(GS, thought, 0)


def _turn(position: int, content: str) -> gen.Turn:
    return gen.Turn(position, 3, [5, 6], FINISH_STOP, None, 11, content, None)


def test_the_record_places_its_turns_and_survives_only_whole(tmp_path: Path) -> None:
    rec = gen.Record("0123456789abcdef", "k1", "sha", GS.identity(),
                     [_turn(2, "Hi back."), _turn(5, "Appended.")])
    conv = rec.conversation([SYS, U1, A1, U2, A2], [2, 4, 5], "keep")
    assert [m["content"] for m in conv] == ["Be brief.", "Hi", "Hi back.", "And then?",
                                            "Then.", "Appended."]
    gen.save(tmp_path, rec)
    path = gen.record_path(tmp_path, "k1")
    assert path.parent.parent.name == "generated" and not list(path.parent.glob(".*"))
    assert gen.load(tmp_path, rec.run, "k1", "sha", GS.identity()) == rec
    # another run, another version of the record, other settings: not this sample's
    assert gen.load(tmp_path, "f" * 16, "k1", "sha", GS.identity()).turns == []
    assert gen.load(tmp_path, rec.run, "k1", "sha2", GS.identity()).turns == []
    assert gen.load(tmp_path, rec.run, "k1", "sha", replace(GS, top_k=5).identity()).turns == []
    # a record damaged on disk is not trusted: its checksum no longer matches
    body = json.loads(path.read_text())
    body["turns"][0]["output_ids"] = [5, 5]
    path.write_text(json.dumps(body))
    assert gen.load(tmp_path, rec.run, "k1", "sha", GS.identity()).turns == []
    path.write_bytes(b"{\"version\": 1, \"tur")
    assert gen.load(tmp_path, rec.run, "k1", "sha", GS.identity()).turns == []


def test_a_record_that_does_not_read_back_is_corrupt(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    rec = gen.Record("0123456789abcdef", "k1", "sha", GS.identity(), [_turn(1, "x")])
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes",
                        lambda p: real(p).replace(b"\"x\"", b"\"y\"") if p.suffix == ".json"
                        else real(p))
    with pytest.raises(Corrupt, match="does not read back as written"):
        gen.save(tmp_path, rec)


def test_seeds_are_the_runs_and_the_samples_and_fit_every_engine() -> None:
    seed = gen.seed_for("0123456789abcdef", "k1", 0)
    assert seed == gen.seed_for("0123456789abcdef", "k1", 0) and 0 <= seed < 2**31
    assert len({seed, gen.seed_for("0123456789abcdef", "k1", 1),
                gen.seed_for("0123456789abcdef", "k2", 0),
                gen.seed_for("fedcba9876543210", "k1", 0)}) == 4


def test_settings_refuse_what_generation_cannot_run() -> None:
    with pytest.raises(ConfigError) as e:
        Settings(regenerate=True, gen_max_new_tokens=0, gen_temperature=-1, gen_top_p=0,
                 gen_top_k=0, gen_reasoning="hide", gen_on_length="truncate",
                 gen_on_empty="drop", gen_min_tokens_per_s=0)
    for name in ("FARM_GEN_MAX_NEW_TOKENS", "FARM_GEN_TEMPERATURE", "FARM_GEN_TOP_P",
                 "FARM_GEN_TOP_K", "FARM_GEN_REASONING must be one of keep, drop, field",
                 "FARM_GEN_ON_LENGTH must be one of reject, keep", "FARM_GEN_ON_EMPTY",
                 "FARM_GEN_MIN_TOKENS_PER_S"):
        assert name in str(e.value)
    s = Settings.from_env({"FARM_REGENERATE": "1", "FARM_GEN_STOP_TOKEN_IDS": "7, 8"})
    given = GenSettings.of(s)
    assert given is not None and given.stop_token_ids == (7, 8)
    assert GenSettings.of(Settings()) is None


def test_regeneration_is_part_of_the_fingerprint_and_a_plain_run_keeps_its_id() -> None:
    base = Fingerprint("cfg", "tok", "tpl", (2, 4, 5), LAYER_CONVENTION, 64, "bfloat16", 8192,
                       "reject")
    # the id a run had before regeneration existed: the same fields, hashed the same way
    old = {k: v for k, v in base.to_json().items() if k != "generation"}
    old["layers_to_capture"] = [2, 4, 5]
    legacy = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert base.id == legacy
    regen = replace(base, generation=GS.identity())
    other = replace(base, generation=replace(GS, temperature=0.0).identity())
    assert len({base.id, regen.id, other.id}) == 3
    assert Fingerprint.from_json(regen.to_json()) == regen
    assert Fingerprint.from_json(old) == base  # a manifest written before it


def test_a_regenerating_delivery_has_room_for_one_turn_more() -> None:
    plain = Settings()
    regen = Settings(regenerate=True, gen_max_new_tokens=1200, gen_min_tokens_per_s=12)
    extra = (time_limits.for_tokens(regen, 2048, 100).hard_s
             - time_limits.for_tokens(plain, 2048, 100).hard_s)
    assert extra == pytest.approx(1200 / 12 + time_limits.GEN_PREFILL_S)
    slow = Settings(regenerate=True, gen_max_new_tokens=8192, gen_min_tokens_per_s=4)
    with pytest.raises(ConfigError, match="one regenerated turn, 2078s"):
        time_limits.check_visibility(slow, 100)


def test_a_runs_generation_settings_come_back_from_its_fingerprint() -> None:
    s = Settings.from_env({"FARM_REGENERATE": "1", "FARM_GEN_TOP_K": "5",
                           "FARM_GEN_STOP_TOKEN_IDS": "3", "FARM_GEN_REASONING": "field"})
    back = with_generation(Settings(), generation_identity(s))
    assert generation_identity(back) == generation_identity(s) and back.regenerate
    assert not with_generation(s, "").regenerate


def test_a_files_conversation_must_be_its_records_regenerated() -> None:
    record = [SYS, U1, A1, U2]  # a reply to U2 is appended
    good = [SYS, U1, {"role": "assistant", "content": "x"}, U2,
            {"role": "assistant", "content": "y", "reasoning_content": "z"}]
    assert gen.file_conversation(json.dumps(good), record) == good
    for bad, why in ((None, "no regenerated conversation"), ("{", "not JSON"),
                     (json.dumps(good[:4]), "has 4 messages"),
                     (json.dumps([*good[:3], U1, good[4]]), "message 3 differs"),
                     (json.dumps([*good[:2], U1, *good[3:]]), "message 2 is not")):
        with pytest.raises(ValueError, match=why):
            gen.file_conversation(bad, record)


# A Qwen3-style template: a reply's <think> part is placed before its answer in the turns after
# the last user message, and dropped from earlier ones; ``reasoning_content`` is read as well.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is defined else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user and reasoning %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content"
    " + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_thinking_template_places_the_reasoning_per_the_policy(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    from worker.core.errors import BadInput
    from worker.core.samples import Sample
    from worker.server.chat import ChatTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = THINKING_TEMPLATE
    chat = ChatTokenizer(tok, 8192, "reject")
    reply = tok("<think>\nadd them\n</think>\n\n4", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    # the generation prompt is where the reply starts: the template's, as the engine is asked
    prompt = chat.prompt_ids([U1])
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")

    def turn(policy: str, position: int) -> dict[str, str]:
        return gen.make_turn(position, len(prompt), Decoded([*reply, eos], FINISH_STOP, eos),
                             1, policy, chat.end_ids, chat.decode).message(policy)

    # one turn: keep and field both render the reasoning where the template puts it
    for policy in ("keep", "field"):
        encoded = chat.encode(Sample(None, (U1, turn(policy, 1))))
        masked = tok.decode([t for t, m in zip(encoded.input_ids, encoded.loss_mask,
                                               strict=True) if m])
        assert masked == "<think>\nadd them\n</think>\n\n4<|im_end|>\n", policy
    assert "think" not in tok.decode(chat.encode(Sample(None, (U1, turn("drop", 1)))).input_ids)
    # two turns: the first turn's reasoning is dropped once a user turn follows it, so kept in
    # the content the conversation is not prefix-stable: rejected, naming the turn
    with pytest.raises(BadInput, match="not prefix-stable at message 1"):
        chat.encode(Sample(None, (U1, turn("keep", 1), U2, turn("keep", 3))))
    two = chat.encode(Sample(None, (U1, turn("drop", 1), U2, turn("drop", 3))))
    assert sum(two.loss_mask) > 0


def test_a_prompt_without_a_reply_is_a_record_of_a_regenerating_run_only() -> None:
    from worker.core.errors import BadInput
    from worker.core.samples import validate_record

    record = {"id": "p", "messages": [SYS, U1]}
    with pytest.raises(BadInput, match=r"no assistant turn.*FARM_REGENERATE=1"):
        validate_record(record)
    assert validate_record(record, prompts=True).messages == (SYS, U1)


def test_a_turn_starts_only_with_its_time_and_half_the_extractions_left() -> None:
    # a delivery of 300 s whose turn may take 100 s: it needs 100 + (300 - 100) / 2 = 200 s
    now = time.monotonic()
    step._time_for_a_turn("k", 0, now + 250, 300, 100)
    with pytest.raises(OutOfTime, match=r"turn 2 and the extraction after it.*no attempt spent"):
        step._time_for_a_turn("k", 1, now + 150, 300, 100)


def test_generations_have_their_own_places_from_the_servers_limits() -> None:
    regen = Settings(regenerate=True)
    assert generation_limits(regen, {"max_running_requests": 128}).max_in_flight == 128
    assert generation_limits(regen, {}).max_in_flight == DEFAULT_GEN_IN_FLIGHT
    assert generation_limits(replace(regen, gen_max_in_flight=16),
                             {"max_running_requests": 128}).max_in_flight == 16
    assert generation_limits(regen, {"max_running_requests": 4096}).max_in_flight == MAX_SLOTS
    two = generation_limits(regen, {"max_running_requests": 64, "attn_dp_size": 2})
    assert two.dp_groups == 2 and two.dump_budget_bytes == 0
