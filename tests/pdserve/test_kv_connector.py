"""The engine's KV-connector interface: its metadata's encoding, and the hooks every rank's worker side sees per step
(in order, with the scheduler side's typed metadata), on a real 2-rank pod."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_connector import KVConnectorMetadata, KVConnectorScheduler, KVConnectorSpec, KVSaveRequest
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.testing import RecordingKVConnector


def test_metadata_round_trip():
    for meta in (
        KVConnectorMetadata(),
        KVConnectorMetadata((KVSaveRequest("l-1", "r-1", (3, 9, 27), 40),)),
        KVConnectorMetadata(
            (KVSaveRequest("", "\u00e9t\u00e9", (), 0), KVSaveRequest("lease-\u4e2d", "r", tuple(range(70)), 1111))
        ),
    ):
        assert KVConnectorMetadata.decode(meta.encode()) == meta


class _SaveLastChunks(KVConnectorScheduler):
    """Names the requests whose last prompt chunk runs in the step (as the prefill pod does); None otherwise."""

    def __init__(self) -> None:
        self.built: list[KVConnectorMetadata | None] = []

    def build_connector_meta(self, step):
        chunks = zip(step.seqs[step.num_decodes :], step.chunk_lens[step.num_decodes :])  # decode rows lead
        done = [s for s, n in chunks if s.num_computed + n == s.num_tokens]
        saves = tuple(
            KVSaveRequest(f"lease-{s.request_id}", s.request_id, tuple(s.block_tables[0]), s.num_tokens) for s in done
        )
        meta = KVConnectorMetadata(saves) if saves else None
        self.built.append(meta)
        return meta


@pytest.mark.slow
@pytest.mark.parametrize("collectives", ["shm", "gloo"])
def test_hooks_run_in_order_on_every_rank(tiny_factory, collectives):
    model = tiny_factory("llama", num_kv_heads=2)
    eng = LLMEngine(
        EngineConfig(
            model=str(model),
            tensor_parallel_size=2,
            num_kv_blocks=32,
            max_model_len=128,
            prefill_chunk_size=8,
            max_num_batched_tokens=8,
            cpu_collectives=collectives,
        )
    )
    try:
        sched = _SaveLastChunks()
        assert eng.set_kv_connector(sched, KVConnectorSpec(RecordingKVConnector, ("t",))) == [("t", 0), ("t", 1)]
        prompt = list(range(3, 23))  # 20 tokens: chunks of 8, 8, 4; only the last one completes the prompt's KV
        eng.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        metas = [m for m in sched.built if m is not None]
        assert len(sched.built) == 5 and len(metas) == 1  # 3 prefill chunks + 2 decode steps
        saves = tuple((s.request_id, s.block_ids, s.num_tokens) for s in metas[0].saves)
        assert len(saves) == 1 and saves[0][2] == 20 and len(saves[0][1]) == 2
        layers = eng.model_config.num_layers
        want = [
            ("start_load_kv", saves),
            *(("save_kv_layer", i, saves) for i in range(layers)),
            ("wait_for_save", saves),
        ]
        assert eng.executor.connector_call("take_finished") == [want, want]
        assert eng.executor.connector_call("take_finished") == [[], []]  # steps without metadata call nothing
        with pytest.raises(ValueError):
            eng.executor.connector_call("execute")  # only the interface's named operations are dispatched
        assert eng.executor.connector_call("close") == [None, None]
        assert eng.executor.runner.kv_connector is None
        assert all(isinstance(r, RuntimeError) for r in eng.executor.connector_call("take_finished"))
    finally:
        eng.shutdown()
