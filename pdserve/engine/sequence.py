"""A request as the engine tracks it: its tokens, how many have KV in the cache, and its block tables."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill
    WAITING_FOR_KV = "waiting_for_kv"  # decode pod: blocks reserved, KV arriving from a prefill pod
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # monotonically increasing admission order; the youngest is preempted first
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in the cache
    num_cached_prefix: int = 0  # of those, tokens served by the prefix cache
    block_tables: list[list[int]] = field(default_factory=list)  # one per DCP rank
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_text_len: int | None = None  # where to cut the text when a stop string matched
    num_preemptions: int = 0
    hold_kv: bool = False  # prefill pods: keep the blocks when finished, until LLMEngine.release()
    n: int = 1  # sequences to sample from the prompt's logits (parallel sampling); 1 once forked
    index: int = 0  # position in its group of n (0 for single requests)
    group: str | None = None  # the parent request id, for the members of a group of n
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and its k top alternatives
    # Per prompt position 1.. (computed so far): (logprob of the prompt token, top ids, top logprobs).
    prompt_lps: list[tuple[float, list[int], list[float]]] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        """True while some known token (other than a freshly sampled one) still lacks KV."""
        return self.num_computed < self.num_tokens - (1 if self.output_ids else 0)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
