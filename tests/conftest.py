"""Shared fixtures: the default SmolLM2 checkpoint and tiny random checkpoints written per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from pdserve.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory, smollm2_path):
    """tiny_factory(family, **shape) -> path of a random checkpoint (cached per shape for the session)."""
    from pdserve.testing import write_tiny_checkpoint

    made: dict[str, Path] = {}

    def make(family: str = "llama", **kw) -> Path:
        key = family + repr(sorted(kw.items()))
        if key not in made:
            d = tmp_path_factory.mktemp(f"tiny-{family}")
            made[key] = write_tiny_checkpoint(d, family, tokenizer_from=smollm2_path, **kw)
        return made[key]

    return make
