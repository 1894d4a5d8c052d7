"""The ground truth the end-to-end tests compare with: transformers' own greedy generation."""
from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own generate, one prompt at a time (the ground truth)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    outs = []
    for p in prompts:
        g = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs
