"""Fixtures of the prefill service tests: a tiny random checkpoint with room for 4k+ token prompts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from pdserve.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm2) -> Path:
    """2-layer llama (8 q heads, 2 kv heads, head_dim 16) whose context allows a 4,096-token prompt."""
    from pdserve.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("prefill-tiny"), "llama", tokenizer_from=smollm2, seed=3)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["max_position_embeddings"] = 8192  # RoPE has no weights: widening the context changes nothing else
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return path
