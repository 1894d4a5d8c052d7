"""bench/dcp.py's pieces: KV sizing holds the TP-only count and twice that at DCP 2, and a tiny sweep of both
layouts through a real decode pod writes every field the table, ratios and plot read."""

from __future__ import annotations

import math

import pytest

from bench import dcp
from pdserve.default_model import ensure_default_model
from pdserve.testing import write_tiny_checkpoint


def test_kv_sizing_fits_the_tp_only_count_and_dcp_doubles_it():
    wl = dcp.QUICK
    blocks = dcp.kv_blocks_per_rank(wl.mean_tokens, wl.fit_seqs)
    per_seq = math.ceil(wl.mean_tokens / dcp.BLOCK)
    assert blocks // per_seq == wl.fit_seqs
    n = round(wl.mean_tokens)
    assert dcp.local_blocks(n, 1, 0) == per_seq
    # DCP 2: each rank keeps half the tokens, so about twice the requests fit in the same blocks
    half = max(dcp.local_blocks(n, 2, r) for r in range(2))
    assert blocks // half >= 2 * wl.fit_seqs - 1


def test_step_model_recovers_a_linear_step_time():
    points = [
        [dcp.StepRecord(0.0, 0.01 + 0.001 * b + 1e-6 * k, b, k, 0.0)] * reps
        for b, k, reps in ((1, 100, 3), (4, 900, 1), (8, 500, 7), (16, 3000, 2), (2, 2000, 1))
    ]
    m = dcp.fit_step_model(points)
    assert m is not None
    assert m["a_s"] == pytest.approx(0.01, rel=1e-6)
    assert m["b_s_per_seq"] == pytest.approx(0.001, rel=1e-6)
    assert m["c_s_per_kv_token"] == pytest.approx(1e-6, rel=1e-6)
    assert dcp.predict_tok_s(m, 8, 500) == pytest.approx(8 / (0.01 + 0.008 + 0.0005))


def test_step_model_separates_batch_and_kv_costs_with_timed_attention():
    # KV proportional to the batch, as in a sweep of one prompt distribution: the step alone cannot separate b from
    # c, the driver's attention time can.
    points = [
        [dcp.StepRecord(0.0, 0.04 + 0.002 * b + 3e-6 * 700 * b, b, 700 * b, 0.0, {"attention": 3e-6 * 700 * b})]
        for b in (4, 8, 16, 22)
    ]
    m = dcp.fit_step_model(points)
    assert m is not None and m["attention_timed"] == 1.0
    assert m["a_s"] == pytest.approx(0.04, rel=1e-6)
    assert m["b_s_per_seq"] == pytest.approx(0.002, rel=1e-6)
    assert m["c_s_per_kv_token"] == pytest.approx(3e-6, rel=1e-6)


def test_step_model_never_fits_a_negative_term():
    # Steps that shrink as the batch grows (a machine whose share moved between points): least squares would give
    # the batch a negative cost; the fit drops that term instead and keeps every prediction positive.
    points = [[dcp.StepRecord(0.0, dt, b, k, 0.0)] for b, k, dt in ((4, 3000, 0.4), (8, 6000, 0.7), (16, 10000, 0.5))]
    m = dcp.fit_step_model(points)
    assert m is not None and min(m.values()) >= 0
    assert all(dcp.predict_tok_s(m, b, k) > 0 for b, k in ((4, 3000), (128, 80000)))


@pytest.mark.slow
def test_tiny_sweep_writes_every_field(tmp_path):
    # MLA (the main case); the MQA Llama goes through the same pod code with the native decode step.
    path = write_tiny_checkpoint(
        tmp_path / "mla", "deepseek_v3", num_heads=4, num_layers=2, tokenizer_from=ensure_default_model()
    )
    wl = dcp.Workload((40, 56), (6, 8), (2, 8), window_s=0.2, fit_seqs=3)
    res = dcp.run_model("tiny", str(path), 2, (1, 2), wl)
    rows, ratios = dcp.summarize("tiny", res, 2)
    assert len(rows) == 4
    lo, hi = res["layouts"]["dcp1"], res["layouts"]["dcp2"]
    for lay in (lo, hi):
        for p in lay["points"]:
            assert p["output_tok_s"] > 0 and p["preemptions"] == 0
            assert 0 < p["kv_usage_mean"] <= 1
            assert {"python", "model_call", "step"} <= set(p["split_s_per_step"])
    # 8 in flight: TP only holds about 3 at once (the rest wait), DCP 2 about twice as many
    assert lo["points"][1]["running_max"] <= 4 and lo["points"][1]["waiting_mean"] > 0
    assert hi["points"][1]["running_max"] > lo["points"][1]["running_max"]
    assert {"tiny_dcp2_peak_tok_s_vs_dcp1_peak", "tiny_dcp2_max_concurrency_vs_dcp1"} <= set(ratios)
    dcp.plot({"tiny": res}, tmp_path / "dcp.png")
    assert (tmp_path / "dcp.png").stat().st_size > 0
