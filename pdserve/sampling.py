"""The batched sampler (its parameters: pdserve/sampling_params.py).

The sampler follows vLLM's definitions: logprobs are the log-softmax of the raw model logits; then logit_bias,
min_tokens (stop tokens masked), the penalties (repetition over prompt + output tokens, frequency and presence
over output tokens), a structured-output constraint (xgrammar's token bitmask; pdserve/structured.py), temperature,
min_p, top-k and top-p, in that order."""

from __future__ import annotations

import threading
from typing import Callable, NamedTuple, Sequence

import torch

from pdserve import kernels
from pdserve.sampling_params import SamplingParams
from pdserve.structured import GrammarBackend, Matcher, StructuredSpec


class SampleOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, from the raw logits
    top_logprobs: list[tuple[list[int], list[float]] | None]  # per row, when its params ask for alternatives


class Sampler:
    """Samples one token per row; keeps a torch.Generator per seeded request so seeded runs reproduce."""

    def __init__(
        self, eos_token_ids: Sequence[int] = (), grammar_backend: Callable[[], GrammarBackend] | None = None
    ) -> None:
        """grammar_backend: builds the structured-output backend for this model's tokenizer, on first use."""
        self._generators: dict[str, torch.Generator] = {}
        self._prompt_masks: dict[str, torch.Tensor] = {}  # repetition penalty: prompt tokens, built once
        self._matchers: dict[str, Matcher] = {}
        self.eos_token_ids = list(eos_token_ids)
        self._make_backend = grammar_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()

    @property
    def grammar(self) -> GrammarBackend:
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    if self._make_backend is None:
                        raise ValueError("this sampler has no tokenizer for structured output")
                    self._backend = self._make_backend()
        return self._backend

    def compile(self, spec: StructuredSpec) -> None:
        """Compile (and cache) a request's constraint ahead of its first step; raises StructuredOutputError."""
        self.grammar.compile(spec)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._prompt_masks.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
    ) -> SampleOutput:
        """prompt_ids / output_ids: each row's tokens so far (needed when a row uses penalties or min_tokens)."""
        if _plain_greedy(logits, params):  # the common case in one pass (pdserve.kernels)
            tokens, picked = kernels.greedy_pick(logits)
            return SampleOutput(tokens.tolist(), picked.tolist(), [None] * len(params))
        logprobs_all = torch.log_softmax(logits.float(), dim=-1)
        x = logits
        if any(p.processed for p in params):
            if prompt_ids is None or output_ids is None:
                raise ValueError("penalties and min_tokens need each row's prompt_ids and output_ids")
            x = self._process(logits.float().clone(), params, request_ids, prompt_ids, output_ids)
        constrained = [i for i, p in enumerate(params) if p.structured is not None]
        if constrained:
            if output_ids is None:
                raise ValueError("structured output needs each row's output_ids")
            x = self._constrain(
                logits, logits.float().clone() if x is logits else x, params, request_ids, output_ids, constrained
            )
        if all(p.greedy for p in params):
            tokens = x.argmax(dim=-1)
            out_t = tokens.tolist()
        else:
            out_t = []
            for row, p in enumerate(params):
                if p.greedy:
                    tok = int(x[row].argmax())
                else:
                    r = x[row].float()
                    # Shift before dividing: a tiny temperature would turn x / T into inf - inf = NaN probabilities.
                    probs = _filtered_probs((r - r.max()) / p.temperature, p.top_k, p.top_p, p.min_p)
                    tok = int(torch.multinomial(probs, 1, generator=self._generator(request_ids[row], p)))
                out_t.append(tok)
            tokens = torch.tensor(out_t, dtype=torch.long, device=logits.device)
        lps = logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        return SampleOutput(out_t, lps, _top_logprobs(logprobs_all, params))

    def _process(
        self,
        x: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """logit_bias, min_tokens and the penalties on a float32 copy of the batch's logits."""
        n_vocab = x.shape[1]
        dev = x.device
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for i, p in enumerate(params):
            for tok, b in p.logit_bias.items():
                if tok < n_vocab:
                    rows.append(i)
                    cols.append(tok)
                    vals.append(b)
        if rows:
            x.index_put_(
                (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                torch.tensor(vals, dtype=x.dtype, device=dev),
                accumulate=True,
            )
        pen = [i for i, p in enumerate(params) if p.penalized]
        if pen:
            x[pen] = self._penalize(
                x[pen],
                [params[i] for i in pen],
                [request_ids[i] for i in pen],
                [prompt_ids[i] for i in pen],
                [output_ids[i] for i in pen],
            )
        rows, cols = [], []
        for i, p in enumerate(params):
            if len(output_ids[i]) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                for tok in stops:
                    if tok < n_vocab:
                        rows.append(i)
                        cols.append(tok)
        if rows:
            x[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
        # Extreme penalties can overflow: keep masked tokens at -inf and everything else finite.
        x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
        return x

    def _constrain(
        self,
        logits: torch.Tensor,
        x: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        output_ids: Sequence[Sequence[int]],
        rows: list[int],
    ) -> torch.Tensor:
        """Mask, on a float32 copy, every token the row's grammar does not allow next (one bitmask for the batch)."""
        g = self.grammar
        bitmask = g.allocate_bitmask(x.shape[0])
        masked = []
        for i in rows:
            m = self._matchers.get(request_ids[i])
            if m is None:
                m = self._matchers[request_ids[i]] = g.matcher(params[i].structured)  # type: ignore[arg-type]
            m.catch_up(output_ids[i])
            if m.fill(bitmask, i):
                masked.append(i)
        if masked:
            g.apply_bitmask(x, bitmask, masked)
            # min_tokens can mask the stop token a finished grammar asks for: then the grammar wins.
            dead = [i for i in masked if bool(torch.isneginf(x[i]).all())]
            if dead:
                x[dead] = logits[dead].float()
                g.apply_bitmask(x, bitmask, dead)
        return x

    def _penalize(
        self,
        x: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        prompt_ids: list[Sequence[int]],
        output_ids: list[Sequence[int]],
    ) -> torch.Tensor:
        """vLLM's apply_penalties on the rows that use a penalty."""
        n, n_vocab = x.shape
        dev = x.device
        width = max(1, max(len(o) for o in output_ids))
        padded = torch.full((n, width), n_vocab, dtype=torch.long)  # pad with an extra column, dropped below
        for i, o in enumerate(output_ids):
            if o:
                padded[i, : len(o)] = torch.tensor(o, dtype=torch.long)
        counts = torch.zeros(n, n_vocab + 1, dtype=x.dtype, device=dev)
        counts.scatter_add_(1, padded.to(dev), torch.ones(n, width, dtype=x.dtype, device=dev))
        counts = counts[:, :n_vocab]
        out_mask = counts > 0
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=dev).unsqueeze(1)
        if any(p.repetition_penalty != 1 for p in params):
            seen = torch.stack([self._prompt_mask(r, pr, n_vocab, dev) for r, pr in zip(request_ids, prompt_ids)])
            factor = torch.where(seen | out_mask, rep, torch.ones_like(rep))
            x = torch.where(x > 0, x / factor, x * factor)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=dev).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=dev).unsqueeze(1)
        return x - freq * counts - pres * out_mask.to(x.dtype)

    def _prompt_mask(self, request_id: str, prompt: Sequence[int], n_vocab: int, dev: torch.device) -> torch.Tensor:
        m = self._prompt_masks.get(request_id)
        if m is None or m.numel() != n_vocab:
            m = torch.zeros(n_vocab, dtype=torch.bool, device=dev)
            ids = torch.tensor([t for t in prompt if 0 <= t < n_vocab], dtype=torch.long, device=dev)
            m[ids] = True
            self._prompt_masks[request_id] = m
        return m

    def _generator(self, request_id: str, p: SamplingParams) -> torch.Generator | None:
        if p.seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator().manual_seed(p.seed)
            self._generators[request_id] = g
        return g


def _plain_greedy(logits: torch.Tensor, params: list[SamplingParams]) -> bool:
    """Every row greedy on its raw fp32 logits with no alternatives asked for, on a CPU with pdserve's kernels."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or not kernels.available():
        return False
    return all(p.greedy and not p.processed and p.structured is None and not p.top_logprobs for p in params)


def _top_logprobs(
    logprobs_all: torch.Tensor, params: list[SamplingParams]
) -> list[tuple[list[int], list[float]] | None]:
    k_max = max((p.top_logprobs for p in params), default=0)
    if k_max == 0:
        return [None] * len(params)
    vals, idx = logprobs_all.topk(min(k_max, logprobs_all.shape[1]), dim=-1)  # one topk for the whole batch
    v, ix = vals.tolist(), idx.tolist()
    return [(ix[i][: p.top_logprobs], v[i][: p.top_logprobs]) if p.top_logprobs else None for i, p in enumerate(params)]


def _filtered_probs(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    if min_p > 0.0:
        # vLLM's min_p: drop tokens whose probability is below min_p times the most likely token's.
        p = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(p < min_p * p.max(), float("-inf"))
    if top_k > 0 and top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        cum = sorted_p.cumsum(0)
        drop = cum - sorted_p > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        probs = probs / probs.sum()
    return probs
