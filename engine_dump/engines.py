"""Which engine serves the model, found from its answers, and how a request of ours reaches it.

SGLang (and the reference server) answers ``/model_info``; vLLM answers ``/v1/models`` with
``max_model_len``. Each engine's request carrying the rid, its limits, health checks and DP
groups map here onto one shape: the worker's client and ``probe`` have no engine branch. vLLM's
HTTP API does not say its batch budget: its hook's ready marker does.
Test: tests/unit/test_engines.py::test_each_engine_gets_its_own_request_for_the_same_sample
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_dump import markers as mk
from engine_dump.dumpfile import ENV_DUMP_DTYPE

SGLANG, VLLM = "sglang", "vllm"
# What each engine's hook is told by its server's environment (named in every fix)
DUMP_DIR_VARIABLE = {SGLANG: "SGLANG_HS_DUMP_DIR", VLLM: "HSFARM_VLLM_DUMP_DIR"}
DUMP_DTYPE_VARIABLE = {SGLANG: ENV_DUMP_DTYPE, VLLM: "HSFARM_VLLM_DUMP_DTYPE"}
VLLM_KV_PARAMS = "kv_transfer_params"  # the body key vLLM hands to the KV connector
VLLM_RID_PARAM = "hsfarm_rid"  # the key in it the vLLM hook names a request's dump by
VLLM_DP_RANK_HEADER = "X-data-parallel-rank"  # pins a request to one DP rank's engine


@dataclass(frozen=True)
class Engine:
    """What a worker knows of the engine it talks to, from the server's own answers."""

    name: str  # SGLANG or VLLM
    version: str  # "" where the server does not say
    served_model: str  # vLLM: its name for the model (for people); SGLang: the model path
    model_path: str  # the checkpoint the server loaded (SGLang's model_path, vLLM's root)
    max_model_len: int | None = None  # vLLM's, from /v1/models

    @property
    def liveness_path(self) -> str:
        """A cheap request that runs no forward pass."""
        return "/v1/models" if self.name == VLLM else "/model_info"

    @property
    def health_path(self) -> str:
        """SGLang: a one-token generation; vLLM: whether its engine core is alive (503 if not)."""
        return "/health" if self.name == VLLM else "/health_generate"

    @property
    def dump_dir_variable(self) -> str:
        """The variable that gives this engine's hook its dump dir (for fixes)."""
        return DUMP_DIR_VARIABLE[self.name]

    def describe(self) -> str:
        name = "vLLM" if self.name == VLLM else "SGLang"
        return f"{name} {self.version or '(version not said)'} serving {self.model_path}"

    def generate(self, rid: str, input_ids: list[int], dp_rank: int | None,
                 prompt_logprobs: bool = False) -> tuple[str, dict[str, Any], dict[str, str]]:
        """(path, body, headers) of the prefill request for one sample: SGLang decodes
        nothing; vLLM decodes one token (it takes no fewer) and hands the rid to the hook.
        No ``model``: vLLM then serves its base model (no LoRA adapter: the states the run
        is for), whatever name a restart gave it. ``prompt_logprobs``: the answer also holds
        every prompt token's logprob (``prompt_logprobs``), for the proof."""
        if self.name == VLLM:
            body: dict[str, Any] = {"prompt": input_ids, "max_tokens": 1, "temperature": 0,
                                    VLLM_KV_PARAMS: {VLLM_RID_PARAM: rid}}
            if prompt_logprobs:
                body["prompt_logprobs"] = 0  # the prompt token's own, no top-k
            headers = {"X-Request-Id": rid}
            if dp_rank is not None:
                headers[VLLM_DP_RANK_HEADER] = str(dp_rank)
            return "/v1/completions", body, headers
        body = {"rid": rid, "input_ids": input_ids, "sampling_params": {"max_new_tokens": 0}}
        if prompt_logprobs:
            body.update(return_logprob=True, logprob_start_len=0)
        if dp_rank is not None:
            body["routed_dp_rank"] = dp_rank
        return "/generate", body, {}

    def decode(self, rid: str, input_ids: list[int], sampling: Sampling,
               dp_rank: int | None) -> tuple[str, dict[str, Any], dict[str, str]]:
        """(path, body, headers) of a generation from ``input_ids`` (a regenerated turn):
        SGLang's ``/generate`` with its ``sampling_params``, vLLM's ``/v1/completions`` with
        the prompt as token ids and the output's ids returned. No hook dumps it: its rid is
        not one of ours (``rids.parse_rid``) and vLLM's carries no ``kv_transfer_params``.
        The seed goes to both; SGLang honours it only under
        ``--enable-deterministic-inference`` (``Sampling.seed``)."""
        if self.name == VLLM:
            body: dict[str, Any] = {
                "prompt": input_ids, "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k, "seed": sampling.seed,  # vLLM takes it
                "stop_token_ids": list(sampling.stop_token_ids), "return_token_ids": True}
            headers = {"X-Request-Id": rid}
            if dp_rank is not None:
                headers[VLLM_DP_RANK_HEADER] = str(dp_rank)
            return "/v1/completions", body, headers
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": sampling.top_k,
            "stop_token_ids": list(sampling.stop_token_ids)}
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        body = {"rid": rid, "input_ids": input_ids, "sampling_params": params}
        if dp_rank is not None:
            body["routed_dp_rank"] = dp_rank
        return "/generate", body, {}

    def decoded(self, answer: Any) -> Decoded:
        """What a generation's answer says: the output's token ids, why it ended, the prompt's
        length the engine counted.

        Raises:
            ValueError: the answer is not a generation's (no token ids, an unknown end).
        """
        if self.name == VLLM:
            choices = answer.get("choices") if isinstance(answer, dict) else None
            choice = choices[0] if isinstance(choices, list) and choices else None
            if not isinstance(choice, dict):
                raise ValueError(f"no choices in the answer: {answer!r:.200}")
            ids, why = choice.get("token_ids"), choice.get("finish_reason")
            matched = choice.get("stop_reason")
            usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
            prompt = usage.get("prompt_tokens")
        else:
            meta = answer.get("meta_info") if isinstance(answer, dict) else None
            if not isinstance(meta, dict):
                raise ValueError(f"no meta_info in the answer: {answer!r:.200}")
            ids = answer.get("output_ids")
            finish = meta.get("finish_reason")
            why = finish.get("type") if isinstance(finish, dict) else None
            matched = finish.get("matched") if isinstance(finish, dict) else None
            prompt = meta.get("prompt_tokens")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ValueError(f"the answer holds no output token ids: {answer!r:.200}")
        if why not in (FINISH_STOP, FINISH_LENGTH):
            raise ValueError(f"the generation ended as {why!r}, neither stop nor length")
        return Decoded(ids, why, matched if type(matched) is int else None,
                       prompt if type(prompt) is int else None)

    def server_info(self, dump_dir: Path | None, writer: str | None = None) -> dict[str, Any]:
        """vLLM's limits in SGLang's ``/server_info`` names (what admission, the canary and
        the length check read): the context from /v1/models, the batch budget, the most
        requests and the DP ranks from the newest ready marker of a live hook of this
        server start in ``dump_dir`` (``vllm_marker``; none yet: those keys are absent, and
        the callers' defaults apply).

        Raises:
            markers.SharedDumpDir: no ``writer``, and two vLLM servers write ``dump_dir``.
        """
        info: dict[str, Any] = {"engine": VLLM, "version": self.version}
        if self.max_model_len:
            info["context_length"] = self.max_model_len  # prompt + 1 generated token
        said = vllm_marker(dump_dir, writer)
        for ours, theirs in (("chunked_prefill_size", "max_num_batched_tokens"),
                             ("max_running_requests", "max_num_seqs"),
                             ("attn_dp_size", "dp_groups")):
            value = said.get(theirs)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                info[ours] = value
        return info


FINISH_STOP, FINISH_LENGTH = "stop", "length"  # why a generation ended, in both engines' words


@dataclass(frozen=True)
class Sampling:
    """A generation's settings, as both engines take them (``Engine.decode``)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1: every token
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end of sequence
    seed: int | None = None


@dataclass(frozen=True)
class Decoded:
    """A generation's answer: the output's token ids as the engine returned them (a stop or
    end-of-sequence token that ended it included), ``finish`` (``FINISH_STOP`` or
    ``FINISH_LENGTH``), the token it stopped at where the engine says, the prompt's length."""

    output_ids: list[int]
    finish: str
    matched: int | None = None
    prompt_tokens: int | None = None


def vllm_marker(dump_dir: Path | None, writer: str | None = None) -> dict[str, Any]:
    """The newest ready marker of a live vLLM hook in ``dump_dir``, of the server start whose
    process ``writer`` is (a dump's ``dumpfile.M_WRITER``; None: the only one there), with
    that start's DP group count (``markers.dp_groups``); {} when there is none.

    Raises:
        markers.SharedDumpDir: no ``writer``, and two vLLM servers write ``dump_dir``.
    """
    if dump_dir is None:
        return {}
    found = [m for m in mk.markers(dump_dir) if m.info.get("engine") == VLLM]
    mine = mk.of_server(found, writer)
    live = mk.live(mine)
    if not live:
        return {}
    return {**live[-1].info, "dp_groups": mk.dp_groups(live[-1], mine)}


def sglang_engine(model_info: dict[str, Any], version: str = "") -> Engine:
    path = str(model_info.get("model_path", ""))
    return Engine(SGLANG, version, path, path)


def vllm_engine(models: Any, version: str) -> Engine | None:
    """The engine ``/v1/models`` describes, when it is vLLM's answer (its first model carries
    ``max_model_len``); None otherwise."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None
    card = data[0]
    max_len = card.get("max_model_len")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len <= 1:
        return None
    served = str(card.get("id", ""))
    return Engine(VLLM, version, served, str(card.get("root") or served), max_len)


def vllm_model_info(engine: Engine) -> dict[str, Any]:
    """vLLM's model in ``/model_info``'s shape (what the fingerprint and preflight read)."""
    return {"model_path": engine.model_path, "served_model_name": engine.served_model,
            "max_model_len": engine.max_model_len, "engine": VLLM}


def dp_groups(args: Any) -> int:
    """How many attention-DP groups (one scheduler and one writer each) a launch has: from a
    ``ServerArgs`` or a ``/server_info`` dict (vLLM's DP ranks: ``Engine.server_info``).

    SGLang 0.5.23 spells it ``--attn-dp-size N`` or, deprecated, ``--dp-size N
    --enable-dp-attention``; resolution turns the second into ``attn_dp_size = N, dp_size = 1``
    (``arg_groups/parallel_hook.py``), so ``/server_info`` says ``attn_dp_size`` while a raw
    ``ServerArgs`` may still hold the old spelling. Plain ``--dp-size`` alone is data
    parallelism across replicas, not groups of one server's attention.
    """
    def read(name: str) -> Any:
        return args.get(name) if isinstance(args, dict) else getattr(args, name, None)

    width = read("attn_dp_size")
    if isinstance(width, int) and width > 1:
        return width
    old = read("dp_size")
    if read("enable_dp_attention") and isinstance(old, int) and old > 1:
        return old
    return 1


def prompt_logprobs(engine: str, answer: Any, input_ids: list[int]) -> list[float | None]:
    """The server's logprob of each prompt token (position 0: None), from its answer to a
    request made with ``prompt_logprobs``: SGLang's ``meta_info.input_token_logprobs``
    (``[logprob, token id, text]`` from ``logprob_start_len`` 0), vLLM's
    ``choices[0].prompt_logprobs`` (``{token id: {"logprob": ...}}`` per position).

    Raises:
        ValueError: the answer holds none, or they are for other tokens or another length.
    """
    if engine == VLLM:
        choices = answer.get("choices") if isinstance(answer, dict) else None
        said = choices[0].get("prompt_logprobs") if isinstance(choices, list) and choices \
            and isinstance(choices[0], dict) else None
        pairs = [None if p is None else _vllm_pair(p, t)
                 for p, t in zip(said or [], input_ids, strict=False)]
    else:
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        said = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        pairs = [_sglang_pair(p) for p in said or []]
    if not isinstance(said, list) or len(said) != len(input_ids):
        raise ValueError(f"the answer holds {len(said) if isinstance(said, list) else 'no'} "
                         f"prompt logprobs for {len(input_ids)} tokens")
    out: list[float | None] = []
    for pos, (pair, token) in enumerate(zip(pairs, input_ids, strict=True)):
        if pos == 0:
            out.append(None)
            continue
        if pair is None or pair[1] != token:
            raise ValueError(f"prompt logprob {pos} is for token "
                             f"{None if pair is None else pair[1]}, the request's is {token}")
        out.append(pair[0])
    return out


def _sglang_pair(item: Any) -> tuple[float | None, int] | None:
    if not isinstance(item, list | tuple) or len(item) < 2 or not isinstance(item[1], int):
        return None
    value = item[0]
    return (float(value) if isinstance(value, int | float) else None), item[1]


def _vllm_pair(item: Any, token: int) -> tuple[float | None, int] | None:
    entry = item.get(str(token)) if isinstance(item, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), int | float):
        return None
    return float(entry["logprob"]), token
