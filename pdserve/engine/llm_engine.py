"""LLMEngine: tokenize -> schedule -> run the model on every rank -> sample -> stream outputs.

Used directly for offline generation and benchmarks, and inside the prefill and decode services."""
from __future__ import annotations

import collections.abc
import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig  # re-exported: the config lives where no torch is imported
from pdserve.engine.executor import Executor
from pdserve.engine.kv_connector import KVConnectorScheduler, KVConnectorSpec
from pdserve.engine.model_runner import build_step_input
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import FinishReason, Sequence, SeqStatus
from pdserve.model.config import ModelConfig
from pdserve.parallel_config import ModelParallelInfo, validate_parallel_config
from pdserve.sampling import Sampler, SamplingParams
from pdserve.structured import GrammarBackend, StructuredOutputError
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("pdserve.engine")


def resolve_dtype(dtype: str, model_config: ModelConfig) -> str:
    """EngineConfig.dtype as a torch dtype name: "auto" becomes the checkpoint's own dtype."""
    if dtype != "auto":
        return dtype
    return str(model_config.torch_dtype()).removeprefix("torch.")


class RequestError(ValueError):
    """A request this engine refuses (maps to gRPC INVALID_ARGUMENT); the message says what to change."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Per new token, when its params ask for top_logprobs: (token ids, logprobs) of the most likely alternatives.
    new_top_logprobs: list[tuple[list[int], list[float]] | None] = field(default_factory=list)


@dataclass
class _Tracked:
    seq: Sequence
    detok: IncrementalDetokenizer
    text: str = ""  # text generated so far (before stop-string truncation)
    emitted: int = 0  # characters of text already streamed
    pending_ids: list[int] = field(default_factory=list)
    pending_lps: list[float] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.model is None:
            from pdserve.default_model import ensure_default_model

            cfg.model = str(ensure_default_model())
        self.model_config = ModelConfig.from_path(cfg.model)
        validate_parallel_config(ModelParallelInfo.from_hf_config(self.model_config.raw), cfg.parallel)
        mc = self.model_config
        self.max_model_len = cfg.max_model_len or min(mc.max_position_embeddings, 8192)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({mc.max_position_embeddings})")
        self.tokenizer = Tokenizer(cfg.model)
        self.dtype = resolve_dtype(cfg.dtype, mc)
        self.executor = Executor.create(cfg.model, cfg.tensor_parallel_size, cfg.decode_context_parallel_size,
                                        cfg.dcp_kv_cache_interleave_size, cfg.num_kv_blocks, cfg.block_size,
                                        self.max_model_len, cfg.device, cfg.attention_backend,
                                        exact_prefill=cfg.exact_prefill, cpu_collectives=cfg.cpu_collectives,
                                        cpu_pinning=cfg.cpu_pinning, dtype=self.dtype)
        self.eos_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self._init_requests()

    @classmethod
    def bookkeeping(cls, config: EngineConfig, max_model_len: int) -> LLMEngine:
        """An engine with block manager, scheduler and request tables but no model, tokenizer or ranks: admission
        accounting (reserve, knows, block_tables_of) exactly as a live engine does it; running the model fails."""
        eng = cls.__new__(cls)
        eng.config = config
        eng.max_model_len = max_model_len
        eng._init_requests()
        return eng

    def _init_requests(self) -> None:
        cfg = self.config
        self.blocks = BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.decode_context_parallel_size,
                                   cfg.dcp_kv_cache_interleave_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefill_chunk_size)
        self.sampler = Sampler(sorted(getattr(self, "eos_ids", ())), self._grammar_backend)
        self._tracked: dict[str, _Tracked] = {}
        self._arrival = itertools.count()
        self.num_prompt_tokens_computed = 0  # prefill work actually done (prefix hits excluded)
        # Prefill pods: finished requests added with hold_kv=True keep their blocks here until release().
        self.held: dict[str, Sequence] = {}
        # The KV connector's driver side: builds each step's metadata for every rank's worker side (kv_connector.py).
        self.kv_scheduler: KVConnectorScheduler | None = None
        self.num_generated_tokens = 0

    def _grammar_backend(self) -> GrammarBackend:
        """Structured output's backend for this model's tokenizer and logits width (built on first use)."""
        return GrammarBackend.for_tokenizer(self.tokenizer.hf_tokenizer, self.model_config.vocab_size,
                                            sorted(self.eos_ids))

    # --- requests ---
    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("prompt is empty: send at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad!r} is out of range [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}: "
                               f"shorten the prompt to at most {self.max_model_len - 1} tokens")
        if not isinstance(params, SamplingParams):
            raise RequestError("params must be a SamplingParams")
        bad = next((t for t in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias token id {bad} is out of range [0, {vocab})")
        if params.structured is not None:
            try:
                self.sampler.compile(params.structured)  # cached: a spec compiles once per tokenizer
            except StructuredOutputError as e:
                raise RequestError(f"structured output: {e}") from None

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, hold_kv: bool = False) -> str:
        """hold_kv (prefill pods): when the request finishes its blocks stay allocated (in self.held) until
        release(request_id), so a KV transfer can read them."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        seq = self._new_sequence(ids, params, request_id)
        seq.hold_kv = hold_kv
        self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(self, ids: list[int], params: SamplingParams, request_id: str | None) -> Sequence:
        self.validate_prompt(ids, params)
        rid = request_id or uuid.uuid4().hex
        if rid in self._tracked or rid in self.held:
            raise RequestError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, ids, params, next(self._arrival))
        self._tracked[rid] = _Tracked(seq, IncrementalDetokenizer(self.tokenizer, ids))
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its KV blocks are free when this returns."""
        tr = self._tracked.pop(request_id, None)
        if tr is None:
            return self.release(request_id)
        self.scheduler.finish(tr.seq, FinishReason.CANCELLED)
        self.sampler.forget(request_id)
        return True

    def release(self, request_id: str) -> bool:
        """Free the blocks of a finished hold_kv request; False when none are held under this id."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.blocks.free(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    def knows(self, request_id: str) -> bool:
        """request_id is a request of this engine (waiting, awaiting its KV or running)."""
        return request_id in self._tracked

    def block_tables_of(self, request_id: str) -> list[list[int]] | None:
        """The block table per DCP rank of a request, None when it is unknown or holds no blocks."""
        tr = self._tracked.get(request_id)
        if tr is None or not tr.seq.block_tables:
            return None
        return [list(t) for t in tr.seq.block_tables]

    # --- pods that receive a prompt's KV from elsewhere (decode pods) ---
    def reserve(self, request_id: str, num_tokens: int, want_tokens: int) -> Sequence | None:
        """Blocks for want_tokens on every DCP rank for a request whose prompt is not known yet, held by a
        placeholder sequence until adopt() or free_reserved(); None when they do not fit now."""
        seq = Sequence(request_id, [0] * num_tokens, SamplingParams(), next(self._arrival))
        if not self.blocks.can_allocate(seq, want_tokens):
            return None
        self.blocks.allocate(seq, want_tokens)
        seq.status = SeqStatus.WAITING_FOR_KV
        return seq

    def free_reserved(self, reserved: Sequence) -> None:
        """Give a reservation's blocks back (it was never adopted)."""
        self.blocks.free(reserved)

    def adopt(self, reserved: Sequence, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Turn a reservation into a request awaiting its KV: it keeps the reservation's blocks and arrival order.
        Raises RequestError for a bad prompt (the reservation is untouched then)."""
        seq = self._new_sequence(prompt_ids, params, reserved.request_id)
        seq.arrival = reserved.arrival
        seq.block_tables, reserved.block_tables = reserved.block_tables, []
        seq.status = SeqStatus.WAITING_FOR_KV
        self.scheduler.awaiting_kv[seq.request_id] = seq
        return seq

    def add_awaiting_kv(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                        headroom: int = 0) -> Sequence | None:
        """A request whose prompt KV someone else writes: its prompt's blocks now, keeping headroom blocks per rank
        free; None (nothing kept) when they do not fit. Raises RequestError for a bad prompt or a used id."""
        seq = self._new_sequence(prompt_ids, params, request_id)
        fits = self.blocks.can_allocate(seq, seq.num_tokens, reserve=headroom)
        if not fits or not self.scheduler.reserve_for_kv(seq):
            del self._tracked[request_id]
            return None
        return seq

    def start_decoding(self, seq: Sequence, first_token: int, first_logprob: float) -> RequestOutput:
        """seq's prompt KV is in place and its first token was sampled elsewhere: it decodes from the next step.
        Returns the first token's output, with stop checks and detokenization as for every later token; the token
        does not count in num_generated_tokens (this engine did not sample it)."""
        self.scheduler.kv_landed(seq, first_token, first_logprob)
        seq.output_ids.pop()  # _append_token appends it again, with its checks
        seq.output_logprobs.pop()
        return self._append_token(seq, first_token, first_logprob, sampled_here=False)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.awaiting_kv)

    def set_kv_connector(self, scheduler: KVConnectorScheduler | None,
                         worker: KVConnectorSpec | None = None) -> list[Any]:
        """Install the KV connector: scheduler runs each step on this thread; worker (when given) is built on every
        rank. Returns each rank's worker info() in rank order (exceptions as values; [] without a worker)."""
        self.kv_scheduler = scheduler
        return [] if worker is None else self.executor.start_kv_connector(worker)

    # --- the loop ---
    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if step is None:
            return []
        inp = build_step_input(step, self.config.block_size, self.config.decode_context_parallel_size,
                               self.config.dcp_kv_cache_interleave_size)
        if self.kv_scheduler is not None:
            inp.kv_meta = self.kv_scheduler.build_connector_meta(step)
        logits = self.executor.execute(inp)
        for seq, n in zip(step.seqs, step.chunk_lens):
            if step.is_prefill:
                self.num_prompt_tokens_computed += n
            seq.num_computed += n
            self.blocks.register_computed(seq)
        sampled = [step.seqs[i] for i in inp.sample_rows]
        outputs: list[RequestOutput] = []
        if sampled:
            toks, lps, tops = self.sampler.sample(logits, [s.params for s in sampled], [s.request_id for s in sampled],
                                                  [s.prompt_ids for s in sampled], [s.output_ids for s in sampled])
            for seq, tok, lp, top in zip(sampled, toks, lps, tops):
                outputs.append(self._append_token(seq, tok, lp, top=top))
        return outputs

    def _append_token(self, seq: Sequence, tok: int, lp: float, sampled_here: bool = True,
                      top: tuple[list[int], list[float]] | None = None) -> RequestOutput:
        tr = self._tracked[seq.request_id]
        seq.output_ids.append(tok)
        seq.output_logprobs.append(lp)
        if sampled_here:
            self.num_generated_tokens += 1
        before = len(tr.text)
        tr.text += tr.detok.add(tok)
        p = seq.params
        reason: FinishReason | None = None
        stop_at: int | None = None
        may_stop = len(seq.output_ids) >= p.min_tokens  # vLLM: no stop of any kind before min_tokens
        if may_stop and ((tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            reason = FinishReason.STOP
        else:
            if may_stop and p.stop:
                for s in p.stop:
                    i = tr.text.find(s, max(0, before - len(s) + 1))  # a match must end in the new text
                    if i >= 0 and (stop_at is None or i < stop_at):
                        stop_at = i
            if stop_at is not None:
                reason = FinishReason.STOP
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        visible = tr.text if stop_at is None else tr.text[:stop_at]
        # Hold back a tail that could still become a stop string, so no streamed text is ever taken back.
        hold = 0 if reason is not None or not p.stop else max(len(s) for s in p.stop) - 1
        upto = max(tr.emitted, len(visible) - hold)
        delta = visible[tr.emitted:upto]
        tr.emitted = upto
        out = RequestOutput(seq.request_id, [tok], [lp], delta, reason is not None, reason,
                            prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids),
                            cached_tokens=seq.num_cached_prefix, new_top_logprobs=[top])
        if reason is not None:
            self.scheduler.finish(seq, reason, free_blocks=not seq.hold_kv)
            if seq.hold_kv:
                self.held[seq.request_id] = seq
            self.sampler.forget(seq.request_id)
            del self._tracked[seq.request_id]
        return out

    # --- convenience for offline use, tests and benchmarks ---
    def generate(self, prompts: collections.abc.Sequence[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[dict[str, Any]]:
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        results: dict[str, dict[str, Any]] = {
            r: {"request_id": r, "token_ids": [], "logprobs": [], "top_logprobs": [], "text": "", "finish_reason": None}
            for r in rids}
        while any(results[r]["finish_reason"] is None for r in rids):
            for out in self.step():
                res = results.get(out.request_id)
                if res is None:
                    continue
                res["token_ids"] += out.new_token_ids
                res["logprobs"] += out.new_logprobs
                res["top_logprobs"] += out.new_top_logprobs
                res["text"] += out.text_delta
                if out.finished:
                    res["finish_reason"] = out.finish_reason
                    res["cached_tokens"] = out.cached_tokens
        return [results[r] for r in rids]

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
