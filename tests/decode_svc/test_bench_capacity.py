"""bench/decode.py's KV-capacity part (no model run): at a fixed per-rank KV budget AllocateKV admits at least
0.95 x DCP times as many 2,048-token sequences as at DCP 1; DCP 2 is refused for SmolLM2 at TP 9 by the rules."""
from __future__ import annotations


def test_kv_capacity_scales_with_dcp():
    from bench.decode import _capacity

    rows, ratios, raw = _capacity()
    assert set(ratios) == {"kv_capacity_smollm2_dcp3_vs_dcp1_x_3", "kv_capacity_tiny_dcp2_vs_dcp1_x_2",
                           "kv_capacity_tiny_dcp3_vs_dcp1_x_3"}
    assert all(v >= 0.95 for v in ratios.values()), ratios
    smol = raw["capacity"]["SmolLM2-135M"]
    assert smol["dcp2"]["allowed"] is False and "divisible" in smol["dcp2"]["refusal"]
    assert smol["dcp1"]["admitted"] >= 2
    # per-rank blocks of one sequence: ceil(ceil(2048 / dcp) / 16) on every rank
    assert smol["dcp3"]["blocks_per_seq_per_rank"] == [43] * 9
    assert len(rows) == 2
