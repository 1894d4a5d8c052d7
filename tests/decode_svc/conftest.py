"""Fixtures for the decode service tests: tiny checkpoints (8 query heads; 2 KV heads and MQA) and reference TP 1
engines standing in for the prefill pod."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from dsvc_helpers import PrefillStandIn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from pdserve.default_model import ensure_default_model
    from pdserve.testing import write_tiny_checkpoint

    tok = ensure_default_model()
    root = tmp_path_factory.mktemp("decode-tiny")
    return {
        "gqa": write_tiny_checkpoint(root / "gqa", num_heads=8, num_kv_heads=2, seed=1, tokenizer_from=tok),
        "mqa": write_tiny_checkpoint(root / "mqa", num_heads=8, num_kv_heads=1, seed=2, tokenizer_from=tok),
    }


@pytest.fixture(scope="session")
def prefill_standins(tiny_models):
    made = {name: PrefillStandIn(p) for name, p in tiny_models.items()}
    yield made
    for m in made.values():
        m.close()
