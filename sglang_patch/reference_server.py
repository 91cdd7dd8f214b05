"""Reference server: SGLang's HTTP subset over a transformers model, through the same dump code.

``python -m sglang_patch.reference_server --dump-dir D [--model tiny|synthetic|PATH]`` serves
``POST /generate`` (prefills, and generations: sampling.py), ``GET /health``,
``/health_generate``, ``/model_info``, ``/server_info`` (and ``/get_`` aliases). As SGLang, it
batches requests, splits a prompt over the chunk budget, runs health checks as real forwards
and may answer before the dump is renamed. For tests, the demo and CPU-only users (SGLang
itself: tests/live/). Test: tests/farm/test_reference_server.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from engine_dump import dumpdir
from engine_dump.checkpoint import served_weights, weights_identity
from engine_dump.dump_writer import DumpCollector, DumpWriter, remove_stale_files
from engine_dump.dumpfile import (
    DTYPE_BF16,
    ENV_DUMP_DTYPE,
    M_CONFIG_SHA,
    M_LAYERS,
    M_PATCH_VERSION,
    M_SERVER_VERSION,
    M_WEIGHTS,
    PATCH_VERSION,
    STORE_DTYPES,
)
from engine_dump.markers import write_ready_marker
from sglang_patch import sampling
from sglang_patch.dp_groups import DPGroups, routed_rank_error
from sglang_patch.faults import Fault, FaultyWriter
from sglang_patch.reference_model import ReferenceModel
from sglang_patch.sampling import Sampling
from sglang_patch.synthetic import (
    KIMI_HIDDEN_SIZE,
    KIMI_LAYERS,
    PooledStager,
    SyntheticModel,
    ensure_synthetic_model,
)
from sglang_patch.tiny_model import ensure_tiny_model

log = logging.getLogger("hsfarm.reference_server")
SERVER_VERSION = f"reference-{PATCH_VERSION}"


class BadRequest(Exception):
    """A request SGLang would reject with a 400."""


@dataclass(eq=False)
class _Req:
    rid: str
    ids: list[int]  # the prompt, then each generated token but the last (the next pass's input)
    sampling: Sampling
    future: asyncio.Future[dict[str, Any]]
    cache: Any = None
    pos: int = 0
    next_token: int = 0
    aborted: bool = False
    logprob_start: int | None = None  # return_logprob: from this position on
    logprobs: list[float | None] = field(default_factory=list)  # of positions 0.. so far
    prompt_len: int = 0
    out_ids: list[int] = field(default_factory=list)  # generated so far
    matched: int | None = None  # the stop or EOS token that ended it
    last_logits: torch.Tensor | None = None  # after its last position (a decoding request)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        self.prompt_len = len(self.ids)


@dataclass
class _Batch:
    items: list[tuple[_Req, int, int]] = field(default_factory=list)  # (req, prefix, extend)


class Scheduler:
    """Continuous prefill batching with chunking, like SGLang's scheduler: one per server, or
    one per attention-DP group. ``DPGroups`` runs their forward passes in the model thread."""

    def __init__(self, model: ReferenceModel | SyntheticModel, collector: DumpCollector,
                 chunk_size: int, wake: asyncio.Event, max_batch_tokens: int = 16384,
                 dp_rank: int | None = None, eos_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.eos_ids = eos_ids  # what ends a generation unless it asks ``ignore_eos``
        self.dp_rank = dp_rank  # the attention-DP group this scheduler is (None: no groups)
        self.collector = collector
        self.budget = chunk_size if chunk_size > 0 else max_batch_tokens
        self.chunked = chunk_size > 0
        self._waiting: list[_Req] = []
        self._wake = wake  # shared by the server's schedulers: a submit wakes the loop
        self.running: set[str] = set()
        self.forward_passes = 0
        self.tokens_done = 0

    def submit(self, req: _Req) -> None:
        if req.rid in self.running:
            raise BadRequest(f"Duplicate request ID: {req.rid}")
        self.running.add(req.rid)
        self._waiting.append(req)
        self._wake.set()

    def abort(self, req: _Req) -> None:
        req.aborted = True

    def next_batch(self) -> _Batch:
        """The next pass's batch, after failing what was aborted (empty: nothing to run)."""
        # _finish removes from _waiting: iterate over a copy, never the list itself
        for req in [r for r in self._waiting if r.aborted]:
            self._finish(req, error=asyncio.CancelledError())
        return self._next_batch()

    def fail(self, batch: _Batch, error: BaseException) -> None:
        for req, _, _ in batch.items:
            self._finish(req, error=error)

    def finish_done(self, batch: _Batch) -> list[_Req]:
        """Answer the requests whose last position ran in ``batch`` and that want no further
        token (a decoding request's next token is the next pass's input); returns them."""
        done = [req for req, _, _ in batch.items
                if req.pos == len(req.ids) and not self._decoded(req)]
        for req in done:
            self._finish(req)
        return done

    def _decoded(self, req: _Req) -> bool:
        """Draw a request's next token when it asks for one; True while it wants another."""
        s = req.sampling
        if len(req.out_ids) >= s.max_new_tokens:
            return False
        if req.last_logits is None:  # the synthetic model has no LM head
            token = req.next_token
        else:
            if req.generator is None:
                req.generator = s.generator()
            token = sampling.next_token(req.last_logits, s, req.generator)
        req.out_ids.append(token)
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.eos_ids):
            req.matched = token
            return False
        if len(req.out_ids) >= s.max_new_tokens:
            return False
        req.ids.append(token)
        return True

    def _next_batch(self) -> _Batch:
        batch, budget = _Batch(), self.budget
        for req in self._waiting:
            remaining = len(req.ids) - req.pos
            take = min(remaining, budget) if self.chunked else remaining
            if take <= 0 or (not self.chunked and batch.items and take > budget):
                break
            batch.items.append((req, req.pos, take))
            budget -= take
        return batch

    def forward(self, batch: _Batch) -> int:
        """Run one pass (in the model thread); returns its token count."""
        if isinstance(self.model, SyntheticModel):  # one pass into pooled buffers, no cat
            out = self.model.forward_batch([(r.ids[p : p + t], p) for r, p, t in batch.items])
            ids, hidden, aux, next_tokens = out.ids, out.hidden, out.aux, out.next_tokens
        else:
            ids, hidden, aux, next_tokens = self._forward_each(batch)
        for (req, _, _), token in zip(batch.items, next_tokens, strict=True):
            req.next_token = token
        self.collector.on_forward(
            rids=[r.rid for r, _, _ in batch.items],
            prefix_lens=[p for _, p, _ in batch.items],
            extend_lens=[t for _, _, t in batch.items],
            input_ids=ids,
            hidden=hidden,
            aux=aux,
        )
        for req, prefix, take in batch.items:
            req.pos = prefix + take
        self.forward_passes += 1
        tokens = sum(take for _, _, take in batch.items)
        self.tokens_done += tokens
        return tokens

    def _forward_each(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                     list[int]]:
        """Each request's chunk on its own cache, concatenated as SGLang's batch is."""
        ids, hidden, aux, next_tokens = [], [], [], []
        for req, prefix, take in batch.items:
            if req.cache is None:
                req.cache = self.model.new_cache()
            chunk = req.ids[prefix : prefix + take]
            out = self.model.forward_chunk(req.cache, chunk, prefix)
            if req.sampling.max_new_tokens and prefix + take == len(req.ids):
                req.last_logits = out.logits
            if req.logprob_start is not None:
                self._add_logprobs(req, out.hidden, prefix, take)
            ids.append(torch.tensor(chunk, dtype=torch.int64))
            hidden.append(out.hidden)
            aux.append(out.aux)
            next_tokens.append(out.next_token)
        return torch.cat(ids), torch.cat(hidden), torch.cat(aux), next_tokens

    def _add_logprobs(self, req: _Req, hidden: torch.Tensor, prefix: int, take: int) -> None:
        """Row i of a chunk predicts the token after it: the logprob of ``ids[prefix+i+1]``."""
        assert isinstance(self.model, ReferenceModel)
        if prefix == 0:
            req.logprobs.append(None)  # the first token has no logprob, as in SGLang
        nxt = req.ids[prefix + 1 : prefix + take + 1]
        req.logprobs.extend(self.model.token_logprobs(hidden, nxt))

    def _finish(self, req: _Req, error: BaseException | None = None) -> None:
        self.running.discard(req.rid)
        req.cache = None
        if req in self._waiting:
            self._waiting.remove(req)
        if req.future.done():
            return
        if error is not None:
            req.future.set_exception(error)
            return
        out_ids = req.out_ids
        prompt = req.ids[: req.prompt_len]
        logprobs = {} if req.logprob_start is None else {
            "input_token_logprobs": [[lp, t, None] for lp, t in
                                     list(zip(req.logprobs[: req.prompt_len], prompt,
                                              strict=True))[req.logprob_start :]],
            "output_token_logprobs": []}
        finish = ({"type": "stop", "matched": req.matched} if req.matched is not None
                  else {"type": "length", "length": req.sampling.max_new_tokens})
        req.future.set_result({
            "text": "",  # the server's handler decodes it
            "output_ids": out_ids,
            "meta_info": {
                "id": req.rid,
                "prompt_tokens": req.prompt_len,
                "completion_tokens": len(out_ids),
                "cached_tokens": 0,
                "finish_reason": finish,
                **({"dp_rank": self.dp_rank} if self.dp_rank is not None else {}),
                **logprobs,
            },
        })


def _parse_generate(body: Any, vocab_size: int, context_len: int,
                    tokenizer: Any) -> tuple[str, list[int], Sampling, int | None]:
    """SGLang's checks of a request, with its messages (400s with its JSON error body)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string (batched requests are not supported)")
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise BadRequest("Either text or input_ids should be provided.")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequest("text must be a string (batched requests are not supported)")
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise BadRequest("input_ids must be a non-empty list of integers")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"The input_ids {bad} is out of vocabulary range [0, {vocab_size}).")
    if len(ids) >= context_len:  # TokenizerManager._validate_one_request
        raise BadRequest(
            f"The input ({len(ids)} tokens) is longer than the model's context length "
            f"({context_len} tokens)."
        )
    max_input = max_req_input_len(context_len)
    if len(ids) >= max_input:  # the scheduler's validate_input_length
        raise BadRequest(
            f"Input length ({len(ids)} tokens) exceeds the maximum allowed length "
            f"({max_input} tokens). Use a shorter input or enable --allow-auto-truncate."
        )
    try:
        sp = sampling.parse(body.get("sampling_params"))
    except sampling.SamplingError as e:
        raise BadRequest(str(e)) from e
    total = len(ids) + sp.max_new_tokens
    if sp.max_new_tokens and total >= context_len:  # TokenizerManager._validate_one_request
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_len} tokens. You requested a total of {total} tokens: {len(ids)} "
            f"tokens from the input messages and {sp.max_new_tokens} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit.")
    return rid, ids, sp, _logprob_start(body, len(ids))


def _logprob_start(body: dict[str, Any], n: int) -> int | None:
    """SGLang's ``return_logprob`` and ``logprob_start_len`` (default -1: none of the prompt's)."""
    if not body.get("return_logprob"):
        return None
    start = body.get("logprob_start_len", -1)
    if type(start) is not int or start >= n:
        raise BadRequest(f"logprob_start_len ({start}) must be an int below the input length")
    return n if start < 0 else start


def max_req_input_len(context_len: int) -> int:
    """SGLang's scheduler: ``min(context_len - 1, pool size - 1) - 5`` (the pool is large)."""
    return context_len - 1 - 5


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}, "object": "error"}, status=status)


class ReferenceServer:
    """The aiohttp application around one Scheduler."""

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.dump_dir = Path(args.dump_dir)
        dumpdir.ensure(self.dump_dir)  # before the model loads: DumpDirUnsafe, with the fix
        self.model_path = _resolve_model(args, Path(args.cache_dir))
        layers = tuple(args.layers_to_capture) if args.layers_to_capture else None
        self.model: ReferenceModel | SyntheticModel
        if args.model == "synthetic":
            if args.threads:
                torch.set_num_threads(args.threads)
            self.model = SyntheticModel(self.model_path, layers_to_capture=layers)
            if args.chunked_prefill_size > 0:  # a pass never holds more rows than its budget
                self.model.pool.min_rows = min(self.model.pool.min_rows,
                                               args.chunked_prefill_size)
        else:
            self.model = ReferenceModel(self.model_path, layers_to_capture=layers,
                                        dtype=getattr(torch, args.dtype), threads=args.threads)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.weights = weights_identity(self.model_path)  # what a worker checks its run by
        self.context_len = args.context_length or self.model.context_len
        meta = {
            M_LAYERS: json.dumps(list(self.model.layers_to_capture)),
            M_CONFIG_SHA: self.model.config_sha256,
            M_PATCH_VERSION: PATCH_VERSION,
            M_SERVER_VERSION: SERVER_VERSION,
            M_WEIGHTS: served_weights(self.weights, str(self.model_path)),
        }
        faults = [Fault.parse(spec) for spec in args.inject_fault]
        if faults:
            norm = (self.model.model.model.norm.weight.detach().float()
                    if isinstance(self.model, ReferenceModel) else None)
            self.writer: DumpWriter = FaultyWriter(self.dump_dir, meta, faults=faults,
                                                   final_norm=norm,
                                                   min_free_bytes=args.dump_reserve_bytes,
                                                   dtype=args.dump_dtype)
        else:
            self.writer = DumpWriter(self.dump_dir, meta, min_free_bytes=args.dump_reserve_bytes,
                                     dtype=args.dump_dtype)
        stager = PooledStager(self.model.pool) if isinstance(self.model, SyntheticModel) else None
        self.collector = DumpCollector(self.writer, stager=stager, ttl_s=args.dump_ttl_s)
        self.scheduler: DPGroups | None = None
        self.server_id = f"reference-{uuid.uuid4().hex[:12]}"
        self.generated_tokens = 0  # by requests that decode (max_new_tokens > 1)

    def ready_info(self) -> dict[str, object]:
        return {
            "server_version": SERVER_VERSION,
            "sglang_version": None,
            "layers_to_capture": list(self.model.layers_to_capture),
            "model_path": str(self.model_path),
            "model_config_sha256": self.model.config_sha256,
            "hidden_size": self.model.hidden_size,
            "tp_size": 1,
            "weights": self.weights,
            "dump_dtype": self.args.dump_dtype,
            # the server is this process, not its parent's child (SGLang's schedulers are)
            "server_id": self.server_id,
        }

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([
            web.post("/generate", self.generate),
            web.get("/health", self.health),
            web.get("/health_generate", self.health_generate),
            web.get("/model_info", self.model_info),
            web.get("/get_model_info", self.model_info),
            web.get("/server_info", self.server_info),
            web.get("/get_server_info", self.server_info),
        ])
        app.on_startup.append(self._start)
        return app

    async def _start(self, app: web.Application) -> None:
        self.scheduler = self._scheduler()
        app["scheduler_task"] = asyncio.create_task(self.scheduler.run())
        stale = remove_stale_files(self.dump_dir)  # as the SGLang hook does at start-up
        write_ready_marker(self.dump_dir, self.ready_info())
        log.info("ready: model=%s dump_dir=%s layers=%s chunk=%s dp groups=%d; %d stale files "
                 "of dead processes removed", self.model_path, self.dump_dir,
                 self.model.layers_to_capture, self.args.chunked_prefill_size,
                 self.args.attn_dp_size, stale)

    def _eos_ids(self) -> frozenset[int]:
        """What ends a generation, as SGLang reads it: the model config's ``eos_token_id``
        (an id or a list) and the tokenizer's."""
        said = getattr(self.model.config, "eos_token_id", None)
        ids = set(said if isinstance(said, list) else [said])
        ids.add(getattr(self.tokenizer, "eos_token_id", None))
        return frozenset(i for i in ids if isinstance(i, int))

    def _scheduler(self) -> DPGroups:
        """One scheduler, or one per attention-DP group stepping together (``dp_groups``)."""
        a = self.args
        wake = asyncio.Event()
        n = max(1, a.attn_dp_size)
        groups = [Scheduler(self.model, self.collector, a.chunked_prefill_size, wake,
                            dp_rank=g if n > 1 else None, eos_ids=self._eos_ids())
                  for g in range(n)]
        return DPGroups(list(groups), wake, a.tokens_per_s, self.dump_dir,
                        forward_delay_s=a.forward_delay_s)

    async def _run(self, rid: str, ids: list[int], sp: Sampling,
                   routed_dp_rank: int | None = None,
                   logprob_start: int | None = None) -> dict[str, Any]:
        sch = self.scheduler
        assert sch is not None
        req = _Req(rid, ids, sp, asyncio.get_running_loop().create_future(),
                   logprob_start=logprob_start)
        sch.submit(req, sch.pick(rid, routed_dp_rank))
        try:
            return await req.future
        except asyncio.CancelledError:
            sch.abort(req)  # client went away: SGLang aborts the request too
            raise

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            return _error(400, f"invalid JSON body: {e}")
        try:
            rid, ids, sp, logprob_start = _parse_generate(
                body, self.model.vocab_size, self.context_len, self.tokenizer)
            if logprob_start is not None and isinstance(self.model, SyntheticModel):
                raise BadRequest("the synthetic model has no LM head: no logprobs")
            if sp.max_new_tokens > 1 and isinstance(self.model, SyntheticModel):
                raise BadRequest("the synthetic model has no LM head: it generates no text")
            # SGLang's name, and its deprecated alias (managers/io_struct.py:419-429)
            rank = body.get("routed_dp_rank", body.get("data_parallel_rank"))
            refusal = routed_rank_error(rank, self.args.attn_dp_size)
            if refusal:
                raise BadRequest(refusal)
            result = await self._run(rid, ids, sp, rank if self.args.attn_dp_size > 1 else None,
                                     logprob_start)
        except BadRequest as e:
            return _error(400, str(e))
        if result["output_ids"]:  # SGLang's default: skip_special_tokens
            result["text"] = self.tokenizer.decode(result["output_ids"],
                                                   skip_special_tokens=True)
        if sp.max_new_tokens > 1:  # a generation (a regenerated turn): for people and tests
            self.generated_tokens += len(result["output_ids"])
            log.info("generated rid=%s prompt=%d output=%d finish=%s", rid, len(ids),
                     len(result["output_ids"]), result["meta_info"]["finish_reason"]["type"])
        return web.json_response(result)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(self._run(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0],
                                             Sampling(max_new_tokens=1, temperature=0)), 20)
        except Exception as e:
            return _error(503, f"health check failed: {e}")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": str(self.model_path),
            "tokenizer_path": str(self.model_path),
            "is_generation": True,
            "model_type": self.model.config.model_type,
            "architectures": list(getattr(self.model.config, "architectures", None) or []),
            "weight_version": "default",
        })

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "version": SERVER_VERSION,
            "model_path": str(self.model_path),
            "chunked_prefill_size": self.args.chunked_prefill_size,
            "context_length": self.args.context_length,  # the flag, as SGLang's (or None)
            "max_req_input_len": max_req_input_len(self.context_len),
            "hsfarm_dump_dir": str(self.dump_dir),
            "hsfarm": self.ready_info(),
            "forward_passes": self.scheduler.forward_passes if self.scheduler else 0,
            "dumps_written": self.writer.written,
            "dump_errors": self.writer.errors,
            "generated_tokens": self.generated_tokens,
            # as SGLang 0.5.23 resolves --attn-dp-size N (or --dp-size N --enable-dp-attention)
            "attn_dp_size": self.args.attn_dp_size, "dp_size": 1,
            "load_balance_method": "round_robin",
            **self._load_info(),
        })

    def _load_info(self) -> dict[str, object]:
        """How busy the model thread was: for load tests (idle = 1 - busy_s / uptime_s)."""
        sch = self.scheduler
        if sch is None:
            return {}
        return {"tokens_per_s_limit": self.args.tokens_per_s, "tokens_done": sch.tokens_done,
                "busy_s": round(sch.busy_s, 4),
                "uptime_s": round(time.monotonic() - sch.started_s, 4),
                "dump_writer_blocked_s": round(self.writer.blocked_s, 4),
                "waiting_requests": len(sch.running),
                **(sch.load() if len(sch.groups) > 1 else {})}


def _resolve_model(args: argparse.Namespace, cache_dir: Path) -> Path:
    model = args.model
    if model == "tiny":
        return ensure_tiny_model(cache_dir)
    if model == "synthetic":
        return ensure_synthetic_model(cache_dir, args.hidden_size, args.num_layers)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model}: no config.json there (a local model dir or 'tiny')")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_patch.reference_server",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dump-dir", required=True, help="where dumps go (tmpfs in production)")
    p.add_argument("--model", default="tiny",
                   help="'tiny' (built locally), 'synthetic' (no model) or a local HF dir")
    p.add_argument("--hidden-size", type=int, default=KIMI_HIDDEN_SIZE,
                   help="synthetic model: hidden size (Kimi-K2: 7168)")
    p.add_argument("--num-layers", type=int, default=KIMI_LAYERS,
                   help="synthetic model: layer count (Kimi-K2: 61)")
    p.add_argument("--tokens-per-s", type=float, default=0.0,
                   help="pace forward passes to this rate (0: as fast as the model runs)")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/hsfarm"),
                   help="where the tiny model is built")
    p.add_argument("--attn-dp-size", type=int, default=1, metavar="N",
                   help="attention-DP groups, as SGLang's --attn-dp-size: one scheduler each, "
                   "round robin or routed_dp_rank, stepping in lockstep (dp_groups.py)")
    p.add_argument("--chunked-prefill-size", type=int, default=8192,
                   help="max tokens per forward pass; -1 disables chunking (SGLang semantics)")
    p.add_argument("--layers-to-capture", type=int, nargs=3, default=None,
                   help="SGLang capture ids (input of layer i); default [2, L//2, L-3]")
    p.add_argument("--context-length", type=int, default=None,
                   help="the longest sequence served, as SGLang's flag (default: the model's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dump-dtype", choices=STORE_DTYPES,
                   default=os.environ.get(ENV_DUMP_DTYPE) or DTYPE_BF16,
                   help=f"hidden states in dumps (default ${ENV_DUMP_DTYPE}, else bfloat16)")
    p.add_argument("--dump-ttl-s", type=float, default=600.0)
    p.add_argument("--dump-reserve-bytes", type=int, default=16 << 20,
                   help="keep this much free in the dump dir; a dump that would not fit → .err")
    p.add_argument("--forward-delay-s", type=float, default=0.0,
                   help="sleep after each forward pass: a slower model, for tests and demos")
    p.add_argument("--inject-fault", action="append", default=[], metavar="KIND:PREFIX[:N]",
                   help="corrupt matching dumps (see sglang_patch/faults.py); tests only")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = ReferenceServer(args)
    except dumpdir.DumpDirUnsafe as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    try:  # run_app turns SIGTERM/SIGINT into a graceful exit; then flush pending dumps
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the
        # request in the scheduler, as SGLang aborts requests whose client went away
        web.run_app(server.app(), host=args.host, port=args.port, access_log=None,
                    print=lambda *_: None, handle_signals=True, handler_cancellation=True)
    finally:
        server.writer.flush(timeout_s=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
