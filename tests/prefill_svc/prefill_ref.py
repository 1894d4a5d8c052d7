"""Helpers of the prefill tests: transformers' own prefill (first token + KV) and reading a pod's cached KV."""

from __future__ import annotations

import asyncio
import random
from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=2)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_prefill(model_path: Path, ids: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(greedy first token, K [layers, tokens, kv_heads, head_dim], V likewise) computed by transformers."""
    model = _hf_model(str(model_path))
    out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    k = torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers])
    v = torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers])
    return int(out.logits[0, -1].argmax()), k, v


def cached_kv(kv_cache: torch.Tensor, table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [layers, tokens, kv_heads, head_dim] of one request from a rank's paged cache."""
    L, _, _, bs, h, d = kv_cache.shape
    t = torch.tensor(table, dtype=torch.long)
    k = kv_cache[:, 0, t].reshape(L, -1, h, d)[:, :num_tokens]
    v = kv_cache[:, 1, t].reshape(L, -1, h, d)[:, :num_tokens]
    return k.clone(), v.clone()


def random_prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def greedy():
    """Engine params + client params for a greedy prefill that continues on decode."""
    from pdserve_api.v1 import common_pb2 as pb
    from prefill_svc.sampling import sampling_from_proto

    return sampling_from_proto(pb.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))


def run(coro):
    return asyncio.run(coro)


def hf_greedy(model_path: Path, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy generate (no EOS stop): the tokens after the prompt."""
    model = _hf_model(str(model_path))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


class Proc:
    """A service subprocess whose stdout/stderr go to a file; ready when `ready()` says so."""

    def __init__(self, cmd: list[str], log_path: Path, ready, timeout: float = 240.0) -> None:
        import os
        import subprocess
        import time

        repo = Path(__file__).resolve().parents[2]
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen(
            cmd, cwd=repo, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        deadline = time.monotonic() + timeout
        while not ready(self):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{cmd[:3]} did not start:\n{self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
