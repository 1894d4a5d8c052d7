"""Continuous batching: which sequences run this step, chunked prefill, admission by free KV, preemption.

Every step first gives each decodable sequence its next token, then fills what is left of max_num_batched_tokens
with prompt chunks (each capped at prefill_chunk_size), as vLLM's V1 scheduler does: decode rows ride along in the
prompt's step, so a stream of prompts slows decoding by the chunk's cost only and never stalls it for a whole step.
Decode rows come first in a step (ScheduledStep.num_decodes), so the attention backend batches them as one."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import FinishReason, SeqStatus, Sequence


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    chunk_lens: list[int]  # new tokens computed per sequence this step
    num_decodes: int = 0  # the leading seqs that decode one token each

    @property
    def is_prefill(self) -> bool:
        """Some prompt chunk runs this step (else every row is a decode)."""
        return len(self.seqs) > self.num_decodes


class Scheduler:
    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk_size: int
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_size = prefill_chunk_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted: holding blocks (prefilling or decoding)
        self.awaiting_kv: dict[str, Sequence] = {}
        self.num_preemptions = 0  # for metrics and tests

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep | None:
        decodes = self._schedule_decode(self.max_num_batched_tokens)
        seqs, chunks = self._schedule_prefill(self.max_num_batched_tokens - len(decodes))
        if not decodes and not seqs:
            return None
        return ScheduledStep(decodes + seqs, [1] * len(decodes) + chunks, len(decodes))

    def _schedule_prefill(self, budget: int) -> tuple[list[Sequence], list[int]]:
        seqs: list[Sequence] = []
        chunks: list[int] = []
        for seq in [s for s in self.running if s.prefilling]:
            n = min(seq.num_tokens - seq.num_computed, self.prefill_chunk_size, budget)
            if n <= 0 or not self.blocks.can_allocate(seq, seq.num_computed + n):
                continue
            self.blocks.allocate(seq, seq.num_computed + n)
            seqs.append(seq)
            chunks.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.blocks.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, self.prefill_chunk_size, budget)
            # Keep a block per running sequence in hand so admitting this one cannot starve their decoding.
            if not self.blocks.can_allocate(seq, seq.num_computed + n, reserve=len(self.running) and 1):
                self.blocks.free(seq)  # give back prefix-cache references; retried next step
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_computed + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            chunks.append(n)
            budget -= n
        return seqs, chunks

    def _schedule_decode(self, budget: int) -> list[Sequence]:
        """The oldest decodable sequences (at most budget), each with a block for its next token; preempts the
        youngest sequences when blocks run out."""
        ready = sorted((s for s in self.running if not s.prefilling), key=lambda s: s.arrival)[:budget]
        scheduled: list[Sequence] = []
        for seq in ready:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below while making room
            while not self.blocks.can_allocate(seq, seq.num_tokens):
                victim = self._youngest(exclude=seq)
                if victim is None:
                    break
                self.preempt(victim)
                if victim in scheduled:
                    scheduled.remove(victim)
            if not self.blocks.can_allocate(seq, seq.num_tokens):
                self.preempt(seq)  # nothing left to evict: this one waits for memory itself
                continue
            self.blocks.allocate(seq, seq.num_tokens)
            scheduled.append(seq)
        return scheduled

    def _youngest(self, exclude: Sequence) -> Sequence | None:
        cands = [s for s in self.running if s is not exclude]
        return max(cands, key=lambda s: s.arrival) if cands else None

    def preempt(self, seq: Sequence) -> None:
        """Free seq's KV and queue it for recomputation at the head of the line (its tokens are kept)."""
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason, free_blocks: bool = True) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.awaiting_kv.pop(seq.request_id, None)
        if free_blocks:
            self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    # --- decode pods: KV arrives from a prefill pod instead of being computed here ---
    def reserve_for_kv(self, seq: Sequence) -> bool:
        """Allocate blocks for seq's prompt so a transfer can land in them; False when there is no room now."""
        if not self.blocks.can_allocate(seq, seq.num_tokens):
            return False
        self.blocks.allocate(seq, seq.num_tokens)
        seq.status = SeqStatus.WAITING_FOR_KV
        self.awaiting_kv[seq.request_id] = seq
        return True

    def kv_landed(self, seq: Sequence, first_token: int, first_logprob: float) -> None:
        """The prompt's KV is in place and prefill sampled the first token: seq decodes from the next step."""
        del self.awaiting_kv[seq.request_id]
        seq.num_computed = len(seq.prompt_ids)
        seq.output_ids.append(first_token)
        seq.output_logprobs.append(first_logprob)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
