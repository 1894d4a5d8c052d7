"""Helpers for the decode service tests (ground truth from transformers, an engine publishing KV as prefill does)."""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import time

from decode_svc.kv_source import PullerFactory, TransferKVSource
from pdserve.testing import EnginePrefill

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPTS = [
    [1, 17, 45, 99, 3, 250, 8, 61, 77, 120, 5, 33, 200],  # 13 tokens
    [1] + [(7 * i + 11) % 250 + 3 for i in range(36)],  # 37 tokens: several blocks and interleave spans
]


class PrefillStandIn(EnginePrefill):
    """A TP 1 engine publishing prompt KV over kv_transfer (TCP), as a prefill pod does; decode pods pull it."""

    def source(
        self, pod, prompt: list[int], num_tokens: int | None = None, timeout_s: float = 60.0
    ) -> TransferKVSource:
        """A KV source for pod on a fresh lease over the prompt's KV (its first num_tokens tokens)."""
        handoff = self.handoff(prompt, num_tokens)
        return TransferKVSource(
            handoff.to_json(), handoff.num_tokens, PullerFactory.for_engine(pod.engine, backend="tcp"), timeout_s
        )

    def stalled_source(self, pod, prompt: list[int], timeout_s: float) -> TransferKVSource:
        """A KV source whose publisher is alive but never finishes a layer (a prefill that stopped mid-prompt):
        pulls from it long-poll until their timeout_s."""
        self.prefill(prompt)
        rid = self._done[tuple(prompt)][0]
        table = self.engine.held[rid].block_tables[0]
        lease = self.publisher.publish(rid, {0: list(table)}, len(prompt), layers_ready=0)
        handoff = self.publisher.handoff(lease)
        return TransferKVSource(
            handoff.to_json(), handoff.num_tokens, PullerFactory.for_engine(pod.engine, backend="tcp"), timeout_s
        )

    def handed(self, pod, prompt: list[int]) -> tuple[TransferKVSource, int, float]:
        """(KV source on a fresh lease, first token, its logprob): what a Decode call carries."""
        first, lp = self.prefill(prompt)
        return self.source(pod, prompt), first, lp


class Handed(collections.abc.Sequence):
    """handed[i] is PrefillStandIn.handed for prompt i, on a new lease at every access (a lease serves one pull)."""

    def __init__(self, standin: PrefillStandIn, pod, prompts: list[list[int]]) -> None:
        self.standin, self.pod, self.prompts = standin, pod, prompts
        for p in prompts:
            standin.prefill(p)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i):  # type: ignore[override]
        return self.standin.handed(self.pod, self.prompts[i])


@dataclasses.dataclass(frozen=True)
class DelayedRankSource:
    """A KV source whose share on one TP rank starts late (that rank's link is slow); picklable, so it reaches the
    rank processes like the real source it wraps."""

    inner: TransferKVSource
    rank: int
    delay_s: float

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    def write_rank(self, conn, block_table: list[int], cancelled=None):
        if conn.runner.ps.tp_rank == self.rank:
            time.sleep(self.delay_s)
        return self.inner.write_rank(conn, block_table, cancelled)


def greedy(max_tokens: int):
    from pdserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def drain_pod(pod, results: dict[str, list[int]], finished: dict[str, str], max_steps: int = 5000) -> None:
    """Step the pod until nothing is queued or running; tokens of every output go to results[request_id]."""
    for _ in range(max_steps):
        if not pod.has_work():
            return
        record(pod.step(), results, finished)
        if pod.only_receiving():  # nothing to compute until a transfer lands: let the ranks' threads run
            time.sleep(0.002)
    raise AssertionError("pod did not finish")


def record(events, results: dict[str, list[int]], finished: dict[str, str]) -> None:
    """Tokens and endings of events (None, what submit returns while the KV is still arriving, is skipped)."""
    from decode_svc.pod import Failure

    for ev in events:
        if ev is None:
            continue
        if isinstance(ev, Failure):
            finished[ev.request_id] = f"failed:{ev.code.name}"
            continue
        results.setdefault(ev.request_id, []).extend(ev.new_token_ids)
        if ev.finished:
            finished[ev.request_id] = ev.finish_reason.value
