"""The ground truth the end-to-end tests compare with: transformers' own greedy generation."""

from __future__ import annotations

from pathlib import Path

import torch

_CACHE: dict[tuple, list[list[int]]] = {}


def hf_greedy(model_path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate, one prompt at a time, no EOS stop (the ground truth); cached per session."""
    from transformers import AutoModelForCausalLM

    key = (str(model_path), tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _CACHE:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        outs = []
        for p in prompts:
            g = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(g[0, len(p) :].tolist())
        _CACHE[key] = outs
    return _CACHE[key]
