"""Sampling parameters, validated at construction, with vLLM's limits and messages: the one home of every rule about a
single request's sampling values. Torch-free, so the router builds one from each request (pdserve/pod/sampling.py's
``requested_params``) and refuses it with these messages before any pod sees it; the pods build theirs the same way.
What needs more than the request (the model's vocabulary, the context length, n / best_of against the engine's bound,
the router's stop-string bounds) is checked by the router (router/core.py). The batched sampler that applies these
parameters is pdserve/sampling.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.structured import StructuredSpec

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 300  # entries; OpenAI's own limit


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
    top_logprobs: int = 0  # alternatives returned per position
    min_tokens: int = 0  # EOS / stop tokens are masked (and stops ignored) until this many output tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: StructuredSpec | None = None  # output constraint (JSON schema, regex, choice, grammar)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise SamplingParamsError(msg)

        def num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def integer(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        t = self.temperature
        if not num(t) or t < 0:
            bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not integer(self.top_k) or self.top_k < -1:
            bad(f"top_k must be an integer >= 1, or 0/-1 to disable, got {self.top_k!r}")
        if not num(self.top_p) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not integer(self.max_tokens) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not integer(self.seed) or not 0 <= self.seed < 2**63):
            bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        if any(not integer(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        # The limits and wording below are vLLM's (vllm.SamplingParams._verify_args).
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not num(v) or not -2.0 <= v <= 2.0:
                bad(f"{name} must be in [-2, 2], got {v!r}.")
        if not num(self.repetition_penalty):  # inf is "greater than zero": say what is wrong with it
            bad(f"repetition_penalty must be a finite number greater than zero, got {self.repetition_penalty!r}.")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be greater than zero, got {self.repetition_penalty!r}.")
        if not num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}.")
        if not integer(self.min_tokens) or self.min_tokens < 0:
            bad(f"min_tokens must be greater than or equal to 0, got {self.min_tokens!r}.")
        if self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if not integer(self.top_logprobs) or self.top_logprobs < 0:
            bad(f"logprobs must be non-negative, got {self.top_logprobs!r}.")
        if self.top_logprobs > MAX_LOGPROBS:
            bad(f"Requested sample logprobs of {self.top_logprobs}, which is greater than max allowed: {MAX_LOGPROBS}")
        if not isinstance(self.logit_bias, dict):
            bad("logit_bias must be a mapping of token id to bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        if any(not integer(k) or k < 0 for k in self.logit_bias):
            bad("logit_bias keys must be non-negative token ids")
        if any(not num(v) for v in self.logit_bias.values()):
            bad("logit_bias values must be finite numbers")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            bad("structured must be a pdserve.structured.StructuredSpec")
        # OpenAI's range; vLLM clamps to it too.
        self.logit_bias = {int(k): min(100.0, max(-100.0, float(v))) for k, v in self.logit_bias.items()}
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """Whether the logits need any work before temperature / top-k / top-p (skipped for plain sampling)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0
