"""bench/decode.py's KV-capacity part (no model run): at a fixed per-rank KV budget AllocateKV admits at least
0.95 x DCP times as many 2,048-token sequences as at DCP 1 (GQA, and MLA at TP 8 with DCP up to 8); DCP 2 is refused
for SmolLM2 at TP 9 by the rules; MLA's per-rank KV bytes per token fall as 1/DCP."""

from __future__ import annotations


def test_kv_capacity_scales_with_dcp():
    from bench.decode import _capacity

    rows, ratios, raw = _capacity()
    assert set(ratios) == {
        "kv_capacity_smollm2_dcp3_vs_dcp1_x_3",
        "kv_capacity_tiny_dcp2_vs_dcp1_x_2",
        "kv_capacity_tiny_dcp3_vs_dcp1_x_3",
        "kv_capacity_mla_dcp2_vs_dcp1_x_2",
        "kv_capacity_mla_dcp4_vs_dcp1_x_4",
        "kv_capacity_mla_dcp8_vs_dcp1_x_8",
    }
    assert all(v >= 0.95 for v in ratios.values()), ratios
    smol = raw["capacity"]["SmolLM2-135M"]
    assert smol["dcp2"]["allowed"] is False and "divisible" in smol["dcp2"]["refusal"]
    assert smol["dcp1"]["admitted"] >= 2
    # per-rank blocks of one sequence: ceil(ceil(2048 / dcp) / 16) on every rank
    assert smol["dcp3"]["blocks_per_seq_per_rank"] == [43] * 9
    mla = raw["capacity"]["DeepSeek-V3 shape (MLA)"]
    assert mla["dcp1"]["admitted"] >= 2 and mla["dcp8"]["allowed"]
    # the engine's latent block: 61 layers x (512 + 64) bf16 values x 16 tokens, the same on every rank
    assert mla["dcp1"]["block_bytes"] == 61 * 576 * 2 * 16 and mla["dcp1"]["kv_dtype"] == "bfloat16"
    assert mla["dcp8"]["blocks_per_seq_per_rank"] == [16] * 8  # 2048 / 8 tokens per rank, 16 per block
    per_tok = raw["capacity"]["kv_bytes_per_token_per_rank"]
    assert per_tok["mla_dcp8"] * 8 == per_tok["mla_dcp1"] and per_tok["mla_dcp8"] < per_tok["gqa_56q8kv_dcp1"]
    assert len(rows) == 4


def test_fp8_kv_admits_twice_the_sequences_of_bf16():
    """At one per-rank budget AllocateKV admits >= 1.95x the 2,048-token SmolLM2 sequences with an fp8 cache (its
    scales counted) as with bf16, and DCP 3 multiplies that again (>= 0.95 x 3)."""
    from bench.decode import _fp8_admission, _kv_bytes_per_block
    from pdserve.default_model import ensure_default_model

    ratios: dict[str, float] = {}
    row, raw = _fp8_admission(ratios)
    assert ratios["kv_capacity_admitted_fp8_vs_bf16"] >= 1.95, (ratios, row)
    assert ratios["kv_capacity_admitted_fp8_dcp3_vs_bf16_dcp1_x_3"] >= 0.95, (ratios, row)
    bf16, _ = _kv_bytes_per_block(str(ensure_default_model()), 9, 16, "auto", "bfloat16")
    fp8, name = _kv_bytes_per_block(str(ensure_default_model()), 9, 16, "fp8", "bfloat16")
    # 30 layers x K/V x one head x 64 x 16 tokens: 2 bytes against 1, plus one float32 scale per (layer, K/V, head)
    assert (bf16, fp8, name) == (30 * 2 * 64 * 16 * 2, 30 * 2 * 64 * 16 + 30 * 2 * 4, "float8_e4m3fn")
    assert raw["fp8_dcp1"]["kv_dtype"] == "float8_e4m3fn" and raw["auto_dcp1"]["kv_dtype"] == "bfloat16"
