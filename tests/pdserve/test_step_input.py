"""StepInput's flat encoding (how a step reaches ranks over shared memory) gives back every field exactly."""

from __future__ import annotations

import torch

from pdserve.engine.kv_connector import KVConnectorMetadata, KVSaveRequest
from pdserve.engine.model_runner import StepInput


def _step(dcp: int, extra, prefill: bool) -> StepInput:
    g = torch.Generator().manual_seed(dcp)
    t, b = (11, 3) if prefill else (3, 3)
    return StepInput(
        is_prefill=prefill,
        input_ids=torch.randint(0, 50_000, (t,), generator=g),
        positions=torch.arange(t),
        cu_seqlens_q=[0, 4, 9, t] if prefill else [0, 1, 2, 3],
        query_start_pos=[0, 17, 2],
        logits_indices=torch.tensor([3, t - 1]),
        sample_rows=[0, 2],
        slot_mappings=[torch.randint(-1, 900, (t,), generator=g) for _ in range(dcp)],
        context_lens=[torch.randint(0, 99, (b,), generator=g) for _ in range(dcp)],
        block_tables=[torch.randint(0, 900, (b, w + 1), generator=g) for w in range(dcp)],
        kv_meta=extra,
    )


def _same(a: StepInput, b: StepInput) -> None:
    assert a.is_prefill == b.is_prefill and a.kv_meta == b.kv_meta
    assert a.cu_seqlens_q == b.cu_seqlens_q and a.query_start_pos == b.query_start_pos
    assert a.sample_rows == b.sample_rows
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("slot_mappings", "context_lens", "block_tables"):
        xs, ys = getattr(a, name), getattr(b, name)
        assert len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys)), name


def test_round_trip_every_layout():
    for dcp in (1, 3):
        for extra in (None, KVConnectorMetadata((KVSaveRequest("lease-1", "req-\u00e9", (4, 5, 6), 40),))):
            for prefill in (False, True):
                step = _step(dcp, extra, prefill)
                _same(StepInput.decode(step.encode()), step)


def test_round_trip_without_rows_to_sample():
    step = _step(2, None, True)
    step.logits_indices, step.sample_rows = torch.zeros(0, dtype=torch.int64), []
    _same(StepInput.decode(step.encode()), step)


def test_round_trip_with_prompt_logprob_rows():
    # Rows scored for prompt logprobs follow the sampled ones in logits_indices: more logits rows than samples.
    step = _step(2, None, True)
    step.logits_indices, step.sample_rows = torch.tensor([10, 0, 1, 2, 3]), [2]
    _same(StepInput.decode(step.encode()), step)
