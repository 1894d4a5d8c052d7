"""Sampling parameters (validated at construction) and the batched sampler."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


class SamplingParamsError(ValueError):
    pass


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1 disables
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = True

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise SamplingParamsError(msg)

        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad(f"top_k must be an integer >= 1, or 0/-1 to disable, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Samples one token per row; keeps a torch.Generator per seeded request so seeded runs reproduce."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> tuple[list[int], list[float]]:
        logprobs_all = torch.log_softmax(logits.float(), dim=-1)
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
            lps = logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
            return tokens.tolist(), lps.tolist()
        out_t, out_lp = [], []
        for row, p in enumerate(params):
            if p.greedy:
                tok = int(logits[row].argmax())
            else:
                x = logits[row].float()
                # Shift before dividing: a tiny temperature would turn x / T into inf - inf = NaN probabilities.
                probs = _filtered_probs((x - x.max()) / p.temperature, p.top_k, p.top_p)
                tok = int(torch.multinomial(probs, 1, generator=self._generator(request_ids[row], p)))
            out_t.append(tok)
            out_lp.append(float(logprobs_all[row, tok]))
        return out_t, out_lp

    def _generator(self, request_id: str, p: SamplingParams) -> torch.Generator | None:
        if p.seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator().manual_seed(p.seed)
            self._generators[request_id] = g
        return g


def _filtered_probs(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
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
