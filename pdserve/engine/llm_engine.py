"""LLMEngine: tokenize -> schedule -> run the model on every rank -> sample -> stream outputs.

Used directly for offline generation and benchmarks, and inside the prefill and decode services."""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import MAX_N, EngineConfig  # re-exported: the config lives where no torch is imported
from pdserve.engine.executor import Executor
from pdserve.engine.kv_connector import KVConnectorScheduler, KVConnectorSpec
from pdserve.engine.model_runner import build_step_input
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import FinishReason, SeqStatus, Sequence
from pdserve.model import gguf_file
from pdserve.model.config import ModelConfig, ModelConfigError
from pdserve.parallel_config import ModelParallelInfo, validate_parallel_config
from pdserve.sampling import Sampler
from pdserve.sampling_params import MAX_LOGPROBS, SamplingParams
from pdserve.structured import GrammarBackend, StructuredOutputError
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("pdserve.engine")


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sequence ``index`` of a parallel-sampling request, by vLLM's rule for the child requests of a
    parent (vLLM v1's parallel_sampling.py, ParentRequest._get_child_sampling_params): with a seed, child i samples
    with seed + i (so child 0 equals the single request with the parent's seed); without one every child shares the
    parent's unseeded params. The sum wraps at 2**63 to stay a valid seed."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**63)


def child_request_id(request_id: str, index: int) -> str:
    """The engine's id of sequence ``index`` of a group: vLLM's "{index}_{request_id}"; sequence 0 keeps the
    parent's id (it is the parent's own sequence until the fork)."""
    return request_id if index == 0 else f"{index}_{request_id}"


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
    # Parallel sampling: which of the request's n sequences this output is about. request_id is the request's,
    # finished says the whole request (all n) is done, finish_reason is set when this sequence ended.
    index: int = 0
    # On the first output of sequence 0 of a request that asked for them: per prompt position 1.. the prompt
    # token's logprob and its top alternatives (ids, logprobs).
    prompt_logprobs: list[tuple[float, list[int], list[float]]] | None = None

    @property
    def seq_finished(self) -> bool:
        """This sequence (of the request's n) ended with this output."""
        return self.finish_reason is not None


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
        if gguf_file.is_gguf(cfg.model) and gguf_file.holds_q8_0(cfg.model):
            if cfg.exact_prefill:
                raise ModelConfigError(
                    f"{cfg.model} holds Q8_0 weights, which run int8; exact_prefill needs full-precision weights: "
                    "drop exact_prefill or give the HF checkpoint directory"
                )
            log.info("%s holds Q8_0 weights: loading them as they are and running int8 (W8A8)", cfg.model)
        validate_parallel_config(ModelParallelInfo.from_hf_config(self.model_config.raw), cfg.parallel)
        mc = self.model_config
        self.max_model_len = cfg.max_model_len or min(mc.max_position_embeddings, 8192)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"({mc.max_position_embeddings})"
            )
        self.tokenizer = Tokenizer(cfg.model)
        self.dtype = resolve_dtype(cfg.dtype, mc)
        self.executor = Executor.create(
            cfg.model,
            cfg.tensor_parallel_size,
            cfg.decode_context_parallel_size,
            cfg.dcp_kv_cache_interleave_size,
            cfg.num_kv_blocks,
            cfg.block_size,
            self.max_model_len,
            cfg.device,
            cfg.attention_backend,
            exact_prefill=cfg.exact_prefill,
            cpu_collectives=cfg.cpu_collectives,
            cpu_pinning=cfg.cpu_pinning,
            dtype=self.dtype,
            kv_cache_dtype=cfg.kv_cache_dtype,
            quantization=cfg.quantization,
        )
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
        self.blocks = BlockManager(
            cfg.num_kv_blocks,
            cfg.block_size,
            cfg.decode_context_parallel_size,
            cfg.dcp_kv_cache_interleave_size,
            cfg.enable_prefix_caching,
        )
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefill_chunk_size)
        self.sampler = Sampler(sorted(getattr(self, "eos_ids", ())), self._grammar_backend)
        self._tracked: dict[str, _Tracked] = {}
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its n sequences, until all have finished
        self._arrival = itertools.count()
        self.num_prompt_tokens_computed = 0  # prefill work actually done (prefix hits excluded)
        # Prefill pods: finished requests added with hold_kv=True keep their blocks here until release().
        self.held: dict[str, Sequence] = {}
        # The KV connector's driver side: builds each step's metadata for every rank's worker side (kv_connector.py).
        self.kv_scheduler: KVConnectorScheduler | None = None
        self.num_generated_tokens = 0

    def _grammar_backend(self) -> GrammarBackend:
        """Structured output's backend for this model's tokenizer and logits width (built on first use)."""
        return GrammarBackend.for_tokenizer(
            self.tokenizer.hf_tokenizer, self.model_config.vocab_size, sorted(self.eos_ids)
        )

    # --- requests ---
    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("prompt is empty: send at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad!r} is out of range [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}: "
                f"shorten the prompt to at most {self.max_model_len - 1} tokens"
            )
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

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        hold_kv: bool = False,
        n: int = 1,
        prompt_logprobs: int | None = None,
    ) -> str:
        """hold_kv (prefill pods): when the request finishes its blocks stay allocated (in self.held) until
        release(request_id), so a KV transfer can read them.

        n > 1 (parallel sampling): the prompt is prefilled once and n first tokens are sampled from its logits (each
        with child_params); the n sequences then share the prompt's KV blocks (BlockManager.fork). Outputs carry
        the sequence's index. prompt_logprobs=k: the prompt tokens' logprobs with k alternatives each (the prompt
        is then computed in full, never from the prefix cache)."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_n(n, params, hold_kv)
        if prompt_logprobs is not None and (
            isinstance(prompt_logprobs, bool)
            or not isinstance(prompt_logprobs, int)
            or not 0 <= prompt_logprobs <= MAX_LOGPROBS
        ):
            raise RequestError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {prompt_logprobs!r}")
        seq = self._new_sequence(ids, params, request_id, n)
        seq.hold_kv = hold_kv
        seq.prompt_logprobs = prompt_logprobs
        self.scheduler.add(seq)
        return seq.request_id

    @staticmethod
    def _check_n(n: int, params: SamplingParams, hold_kv: bool = False) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
        if n > 1 and hold_kv and params.max_tokens != 1:
            raise RequestError("n > 1 with hold_kv needs max_tokens=1 (a prefill pod samples only the first tokens)")

    def _new_sequence(self, ids: list[int], params: SamplingParams, request_id: str | None, n: int = 1) -> Sequence:
        self.validate_prompt(ids, params)
        rid = request_id or uuid.uuid4().hex
        if rid in self._tracked or rid in self.held or rid in self._groups:
            raise RequestError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, ids, params, next(self._arrival), n=n)
        self._tracked[rid] = _Tracked(seq, IncrementalDetokenizer(self.tokenizer, ids))
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request (all n of its sequences); its KV blocks are free when this returns."""
        group = self._groups.pop(request_id, None)
        if group is not None:
            for s in group:
                if self._tracked.pop(s.request_id, None) is not None:
                    self.scheduler.finish(s, FinishReason.CANCELLED)
                    self.sampler.forget(s.request_id)
            self.release(request_id)  # a prefill pod's sequence 0 may hold the prompt's blocks
            return True
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
        return request_id in self._tracked or request_id in self._groups

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

    def detach(self, request_id: str) -> Sequence | None:
        """Drop a request awaiting its KV but keep its blocks, held by the returned sequence until free_reserved():
        a transfer may still be writing into them. None when the request is unknown."""
        tr = self._tracked.pop(request_id, None)
        if tr is None:
            return None
        self.scheduler.finish(tr.seq, FinishReason.CANCELLED, free_blocks=False)
        self.sampler.forget(request_id)
        return tr.seq

    def free_reserved(self, reserved: Sequence) -> None:
        """Give a reservation's blocks back (it was never adopted)."""
        self.blocks.free(reserved)

    def adopt(self, reserved: Sequence, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> Sequence:
        """Turn a reservation into a request awaiting its KV: it keeps the reservation's blocks and arrival order.
        n > 1: the KV will be shared by n sequences (start_decoding_all). Raises RequestError for a bad prompt (the
        reservation is untouched then)."""
        self._check_n(n, params)
        seq = self._new_sequence(prompt_ids, params, reserved.request_id, n)
        seq.arrival = reserved.arrival
        seq.block_tables, reserved.block_tables = reserved.block_tables, []
        seq.status = SeqStatus.WAITING_FOR_KV
        self.scheduler.awaiting_kv[seq.request_id] = seq
        return seq

    def add_awaiting_kv(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, headroom: int = 0, n: int = 1
    ) -> Sequence | None:
        """A request whose prompt KV someone else writes: its prompt's blocks now, keeping headroom blocks per rank
        free (plus one per extra sequence of n, for the copies of the prompt's last block at the fork); None
        (nothing kept) when they do not fit. Raises RequestError for a bad prompt or a used id."""
        self._check_n(n, params)
        seq = self._new_sequence(prompt_ids, params, request_id, n)
        fits = self.blocks.can_allocate(seq, seq.num_tokens, reserve=headroom + n - 1)
        if not fits or not self.scheduler.reserve_for_kv(seq):
            del self._tracked[request_id]
            return None
        return seq

    def start_decoding(self, seq: Sequence, first_token: int, first_logprob: float) -> RequestOutput:
        """seq's prompt KV is in place and its first token was sampled elsewhere: it decodes from the next step.
        Returns the first token's output, with stop checks and detokenization as for every later token; the token
        does not count in num_generated_tokens (this engine did not sample it)."""
        return self.start_decoding_all(seq, [first_token], [first_logprob])[0]

    def start_decoding_all(
        self, seq: Sequence, first_tokens: list[int], first_logprobs: list[float]
    ) -> list[RequestOutput]:
        """start_decoding for a request of n = len(first_tokens) sequences: the landed prompt KV is forked to the
        n sequences (sequence i continues from first_tokens[i]); one output per sequence, in index order."""
        if len(first_tokens) != seq.n or len(first_logprobs) != seq.n:
            raise RequestError(
                f"the request has n={seq.n} but {len(first_tokens)} first tokens / "
                f"{len(first_logprobs)} logprobs were given"
            )
        self.scheduler.kv_landed(seq, first_tokens[0], first_logprobs[0])
        seq.output_ids.pop()  # _append_token appends it again, with its checks
        seq.output_logprobs.pop()
        return self._fan_out(seq, first_tokens, first_logprobs, [None] * len(first_tokens), sampled_here=False)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.awaiting_kv)

    def set_kv_connector(
        self, scheduler: KVConnectorScheduler | None, worker: KVConnectorSpec | None = None
    ) -> list[Any]:
        """Install the KV connector: scheduler runs each step on this thread; worker (when given) is built on every
        rank. Returns each rank's worker info() in rank order (exceptions as values; [] without a worker)."""
        self.kv_scheduler = scheduler
        return [] if worker is None else self.executor.start_kv_connector(worker)

    # --- the loop ---
    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if step is None:
            return []
        inp = build_step_input(
            step,
            self.config.block_size,
            self.config.decode_context_parallel_size,
            self.config.dcp_kv_cache_interleave_size,
        )
        if self.kv_scheduler is not None:
            inp.kv_meta = self.kv_scheduler.build_connector_meta(step)
        logits = self.executor.execute(inp)
        for i, (seq, n) in enumerate(zip(step.seqs, step.chunk_lens)):
            if i >= step.num_decodes:
                self.num_prompt_tokens_computed += n
            seq.num_computed += n
            self.blocks.register_computed(seq)
        if inp.prompt_rows:
            self._score_prompts(step.seqs, logits, inp.prompt_rows)
        sampled = [step.seqs[i] for i in inp.sample_rows]
        outputs: list[RequestOutput] = []
        if sampled:
            # A request of n that samples its first tokens gets n rows of the same logits (one per sequence).
            counts = [s.n if not s.output_ids else 1 for s in sampled]
            rows = [r for r, k in enumerate(counts) for _ in range(k)]
            x = logits[: len(sampled)] if len(rows) == len(sampled) else logits[torch.tensor(rows)]
            members = [(s, i) for s, k in zip(sampled, counts) for i in range(k)]
            toks, lps, tops = self.sampler.sample(
                x,
                [child_params(s.params, i) for s, i in members],
                [child_request_id(s.request_id, i) for s, i in members],
                [s.prompt_ids for s, _ in members],
                [s.output_ids for s, _ in members],
            )
            at = 0
            for seq, k in zip(sampled, counts):
                if k == 1:
                    outputs.append(self._append_token(seq, toks[at], lps[at], top=tops[at]))
                else:
                    outputs.extend(self._fan_out(seq, toks[at : at + k], lps[at : at + k], tops[at : at + k]))
                at += k
        return outputs

    def _score_prompts(
        self, seqs: list[Sequence], logits: torch.Tensor, prompt_rows: list[tuple[int, int, int, int]]
    ) -> None:
        """Prompt logprobs: the log-softmax (fp32) of each prompt position's logits at the next prompt token, and
        the top alternatives."""
        for i, row0, count, first in prompt_rows:
            seq = seqs[i]
            lp = torch.log_softmax(logits[row0 : row0 + count].float(), dim=-1)
            targets = torch.tensor(seq.prompt_ids[first + 1 : first + 1 + count], dtype=torch.long, device=lp.device)
            chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            k = seq.prompt_logprobs or 0
            if k:
                vals, idx = lp.topk(k, dim=-1)
                tops = list(zip(idx.tolist(), vals.tolist()))
            else:
                tops = [([], [])] * count
            seq.prompt_lps.extend((c, t[0], t[1]) for c, t in zip(chosen, tops))

    def _fan_out(
        self,
        seq: Sequence,
        toks: list[int],
        lps: list[float],
        tops: list[tuple[list[int], list[float]] | None],
        sampled_here: bool = True,
    ) -> list[RequestOutput]:
        """seq's n first tokens are out: fork its prompt KV to n - 1 new sequences (full blocks shared, the last
        partly filled one copied; a sequence that finds no free block is queued and recomputed like a preempted
        one), then every sequence takes its token. Sequences that end at their first token (max_tokens=1, as on
        prefill pods) get no KV."""
        rid = seq.request_id
        seq.n, seq.group = 1, rid
        group = [seq]
        copies: list[tuple[int, int, int]] = []
        needs_kv = seq.params.max_tokens > 1
        for i in range(1, len(toks)):
            child = Sequence(
                child_request_id(rid, i),
                list(seq.prompt_ids),
                child_params(seq.params, i),
                seq.arrival,
                index=i,
                group=rid,
                num_cached_prefix=seq.num_cached_prefix,
            )
            self._tracked[child.request_id] = _Tracked(child, IncrementalDetokenizer(self.tokenizer, seq.prompt_ids))
            group.append(child)
            if not needs_kv:
                child.status = SeqStatus.RUNNING  # ends at its first token below, holding nothing
                continue
            forked = self.blocks.fork(seq, seq.num_computed)
            if forked is None:
                child.status = SeqStatus.WAITING
                self.scheduler.waiting.appendleft(child)
                continue
            child.block_tables, more = forked
            copies.extend(more)
            child.num_computed = seq.num_computed
            child.status = SeqStatus.RUNNING
            self.scheduler.running.append(child)
        if copies:
            self.executor.copy_blocks(copies)
        self._groups[rid] = group
        return [self._append_token(s, t, lp, sampled_here, top) for s, t, lp, top in zip(group, toks, lps, tops)]

    def _append_token(
        self,
        seq: Sequence,
        tok: int,
        lp: float,
        sampled_here: bool = True,
        top: tuple[list[int], list[float]] | None = None,
    ) -> RequestOutput:
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
        delta = visible[tr.emitted : upto]
        tr.emitted = upto
        cached = seq.num_cached_prefix  # freeing the blocks below resets it
        finished = reason is not None
        if reason is not None:
            self.scheduler.finish(seq, reason, free_blocks=not seq.hold_kv)
            if seq.hold_kv:
                self.held[seq.request_id] = seq
            self.sampler.forget(seq.request_id)
            del self._tracked[seq.request_id]
            if seq.group is not None:
                finished = all(s.finished for s in self._groups[seq.group])
                if finished:
                    del self._groups[seq.group]
        first_out = len(seq.output_ids) == 1 and seq.prompt_logprobs is not None
        out = RequestOutput(
            seq.group or seq.request_id,
            [tok],
            [lp],
            delta,
            finished,
            reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            cached_tokens=cached,
            new_top_logprobs=[top],
            index=seq.index,
            prompt_logprobs=list(seq.prompt_lps) if first_out else None,
        )
        return out

    # --- convenience for offline use, tests and benchmarks ---
    def generate(
        self,
        prompts: collections.abc.Sequence[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        n: int = 1,
        prompt_logprobs: int | None = None,
    ) -> list[dict[str, Any]]:
        """One result per prompt; with n > 1 its "choices" hold the n sequences' results in index order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        rids = [self.add_request(p, sp, n=n, prompt_logprobs=prompt_logprobs) for p, sp in zip(prompts, plist)]
        results: dict[str, list[dict[str, Any]]] = {
            r: [
                {
                    "request_id": r,
                    "index": i,
                    "token_ids": [],
                    "logprobs": [],
                    "top_logprobs": [],
                    "text": "",
                    "finish_reason": None,
                }
                for i in range(n)
            ]
            for r in rids
        }
        done: set[str] = set()
        while len(done) < len(rids):
            for out in self.step():
                choices = results.get(out.request_id)
                if choices is None:
                    continue
                res = choices[out.index]
                res["token_ids"] += out.new_token_ids
                res["logprobs"] += out.new_logprobs
                res["top_logprobs"] += out.new_top_logprobs
                res["text"] += out.text_delta
                if out.prompt_logprobs is not None:
                    res["prompt_logprobs"] = out.prompt_logprobs
                if out.seq_finished:
                    res["finish_reason"] = out.finish_reason
                    res["cached_tokens"] = out.cached_tokens
                if out.finished:
                    done.add(out.request_id)
        return [results[r][0] if n == 1 else {"request_id": r, "choices": results[r]} for r in rids]

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
