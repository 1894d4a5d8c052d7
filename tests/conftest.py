"""Shared fixtures: the default SmolLM2 checkpoint and tiny random checkpoints written per test session; after each
test module, the memory its in-process engines freed goes back to the system (and the session reports its peak)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
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


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6") if os.name == "posix" else None


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory():
    """glibc keeps the heap pages of freed weights and KV caches in its arenas (each in-process engine left ~200 MB
    of them behind), so over the whole suite this process grew by gigabytes that the pods it starts then lacked;
    malloc_trim gives them back."""
    yield
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def pytest_terminal_summary(terminalreporter) -> None:
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    terminalreporter.write_line(f"pytest process peak RSS: {peak_mb} MB")
