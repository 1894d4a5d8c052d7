"""Helpers for the decode service tests (ground truth from transformers, a stand-in prefill engine)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPTS = [
    [1, 17, 45, 99, 3, 250, 8, 61, 77, 120, 5, 33, 200],  # 13 tokens
    [1] + [(7 * i + 11) % 250 + 3 for i in range(36)],  # 37 tokens: several blocks and interleave spans
]


_HF_CACHE: dict = {}


def hf_greedy(model_path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate, one prompt at a time, no EOS stop (the ground truth); cached per session."""
    from transformers import AutoModelForCausalLM

    key = (str(model_path), tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _HF_CACHE:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        outs = []
        for p in prompts:
            g = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
        _HF_CACHE[key] = outs
    return _HF_CACHE[key]


class PrefillStandIn:
    """A TP 1 engine computing prompt KV + first token, handed to decode pods through a KVSource."""

    def __init__(self, model_path: Path) -> None:
        from pdserve.engine.llm_engine import EngineConfig, LLMEngine

        self.engine = LLMEngine(EngineConfig(model=str(model_path), num_kv_blocks=256, block_size=16,
                                             enable_prefix_caching=False))
        self._cache: dict = {}

    def prefill(self, prompt: list[int]):
        from decode_svc.kv_source import prompt_kv_from_engine

        key = tuple(prompt)
        if key not in self._cache:
            self._cache[key] = prompt_kv_from_engine(self.engine, prompt)
        return self._cache[key]



def greedy(max_tokens: int):
    from pdserve.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def drain_pod(pod, results: dict[str, list[int]], finished: dict[str, str], max_steps: int = 5000) -> None:
    """Step the pod until nothing is queued or running; tokens of every output go to results[request_id]."""
    for _ in range(max_steps):
        if not pod.has_work():
            return
        record(pod.step(), results, finished)
    raise AssertionError("pod did not finish")


def record(events, results: dict[str, list[int]], finished: dict[str, str]) -> None:
    from decode_svc.pod import Failure

    for ev in events:
        if isinstance(ev, Failure):
            finished[ev.request_id] = f"failed:{ev.code.name}"
            continue
        results.setdefault(ev.request_id, []).extend(ev.new_token_ids)
        if ev.finished:
            finished[ev.request_id] = ev.finish_reason.value


def tcp_publisher(standin: PrefillStandIn):
    """A kv_transfer TCP publisher over the stand-in prefill engine's cache (what a prefill pod runs)."""
    from kv_transfer.factory import make_publisher
    from kv_transfer.layout import KVLayout

    eng = standin.engine
    mc, cache = eng.model_config, eng.executor.kv_cache
    layout = KVLayout(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                      dtype="float32", block_size=eng.config.block_size, tp_size=1,
                      num_blocks=eng.config.num_kv_blocks)
    return make_publisher(layout, {0: cache}, backend="tcp", lease_timeout_s=60.0)


def prefill_and_publish(standin: PrefillStandIn, publisher, prompt: list[int], rid: str):
    """Prefill on the stand-in engine, keep its blocks, publish them: (handoff, first token, logprob).
    Call standin.engine.abort(rid) after the decode side pulled."""
    from pdserve.sampling import SamplingParams

    eng = standin.engine
    eng.add_request(list(prompt), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), rid)
    first = None
    while first is None:
        for out in eng.step():
            if out.request_id == rid:
                first = (out.new_token_ids[0], out.new_logprobs[0])
    seq = next(s for s in eng.scheduler.running if s.request_id == rid)
    lease = publisher.publish(rid, {0: list(seq.block_tables[0])}, len(prompt),
                              layers_ready=eng.model_config.num_layers)
    return publisher.handoff(lease), first[0], first[1]
