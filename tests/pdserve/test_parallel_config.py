"""Tests for pdserve.parallel_config: vLLM's parallel-config rules, the fix search, and the layout helpers.

Where the expected messages come from (see also the module docstring):
  - "tp_size=... must be divisible by dcp_size=..."        vllm/config/parallel.py @ 00193b82b0
  - "Total number of attention heads ..."                  vllm/config/model.py verify_with_parallel_config
  - the three DCP GQA/MQA messages                         vllm/config/model.py @ c794754062 (model.py:1390); the
                                                           q-per-kv one's tail from a third-party copy of the text
  - "Block_size(...) should be greater than or equal ..."  vllm/config/vllm.py VllmConfig.__post_init__
  - "DCP not support sliding window."                      vllm/v1/kv_cache_interface.py SlidingWindowSpec
  - "... must divide the number of TP ranks per KV head ..." pdserve's own rule (DCP group shares a KV head)
The reference below restates the rules independently, as plainly as possible, so the module is checked against it
rather than against itself.
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.parallel_config import (
    RULES,
    Fix,
    ModelParallelInfo,
    ParallelConfig,
    ParallelConfigError,
    Verdict,
    check_parallel_config,
    dcp_group_ranks,
    dcp_local_count,
    dcp_local_index,
    dcp_local_num_blocks,
    dcp_owner,
    dcp_rank_of,
    kv_heads_for_tp_rank,
    num_local_kv_heads,
    q_heads_for_tp_rank,
    validate_parallel_config,
)

# --------------------------------------------------------------------------------------------------------------
# Independent restatement of the rules
# --------------------------------------------------------------------------------------------------------------

SEED_TP_GT_KV = (
    "Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` ({tensor_parallel_size}) to be "
    "greater than the model's total number of KV heads ({total_num_kv_heads}). Increase `--tensor-parallel-size` "
    "or set `--decode-context-parallel-size 1`."
)
SEED_MAX_DCP = (
    "`--decode-context-parallel-size` ({decode_context_parallel_size}) exceeds the maximum supported value "
    "({max_dcp_size}) for `--tensor-parallel-size` ({tensor_parallel_size}) and {total_num_kv_heads} model KV heads."
)


def is_pos_int(v):
    return type(v) is int and v >= 1


def reference(H, kv, mla, sw, tp, dcp, pp, inter, bs):
    """(rule, message) of the first failing rule, or None. Straight-line, no cleverness."""
    for flag, v in (
        ("--pipeline-parallel-size", pp),
        ("--tensor-parallel-size", tp),
        ("--decode-context-parallel-size", dcp),
        ("--dcp-kv-cache-interleave-size", inter),
        ("--block-size", bs),
    ):
        if not is_pos_int(v):
            return "positive_sizes", f"`{flag}` must be a positive integer (>= 1), got {v!r}."
    if tp % dcp != 0:
        return "tp_divisible_by_dcp", f"tp_size={tp} must be divisible by dcp_size={dcp}."
    if H % tp != 0:
        return (
            "heads_divisible_by_tp",
            f"Total number of attention heads ({H}) must be divisible by tensor parallel size ({tp}).",
        )
    if dcp > 1 and not mla:
        if not tp > kv:
            return "dcp_tp_gt_kv_heads", SEED_TP_GT_KV.format(tensor_parallel_size=tp, total_num_kv_heads=kv)
        if dcp > tp // kv:
            return "dcp_max_size", SEED_MAX_DCP.format(
                decode_context_parallel_size=dcp,
                max_dcp_size=tp // kv,
                tensor_parallel_size=tp,
                total_num_kv_heads=kv,
            )
        if (H // kv) % dcp != 0:
            return (
                "dcp_q_per_kv",
                f"The model's number of query heads per KV head ({H // kv}) must be divisible by "
                f"`--decode-context-parallel-size` ({dcp}) for GQA/MQA.",
            )
    if dcp > 1 and (inter > bs or bs % inter != 0):
        return (
            "interleave_block_size",
            f"Block_size({bs}) should be greater than or equal to and divisible by "
            f"cp_kv_cache_interleave_size ({inter}).",
        )
    if not mla and kv % tp != 0 and tp % kv != 0:
        return (
            "kv_heads_split",
            f"The model's total number of KV heads ({kv}) cannot be split evenly across "
            f"`--tensor-parallel-size` ({tp}) ranks: one of them must divide the other "
            f"(vLLM's QKVParallelLinear refuses this at model load).",
        )
    if dcp > 1 and not mla and (tp // kv) % dcp != 0:
        return (
            "dcp_group_kv_head",
            f"`--decode-context-parallel-size` ({dcp}) must divide the number of TP ranks per KV head "
            f"(`--tensor-parallel-size` {tp} // {kv} KV heads = {tp // kv}) so that every decode context "
            "parallel group holds the same KV head.",
        )
    if dcp > 1 and sw is not None:
        return "dcp_sliding_window", "DCP not support sliding window."
    return None


def ref_of(model: ModelParallelInfo, cfg: ParallelConfig):
    return reference(
        model.num_attention_heads,
        model.num_kv_heads,
        model.use_mla,
        model.sliding_window,
        cfg.tensor_parallel_size,
        cfg.decode_context_parallel_size,
        cfg.pipeline_parallel_size,
        cfg.dcp_kv_cache_interleave_size,
        cfg.block_size,
    )


# (heads, kv heads, mla) -- GQA, MHA, MQA, odd GQA, and an MLA model (DeepSeek-V2-Lite-like head counts).
MODELS = [
    (32, 8, False),
    (32, 32, False),
    (32, 1, False),
    (64, 8, False),
    (40, 8, False),
    (24, 6, False),
    (24, 2, False),
    (16, 16, True),
    (128, 128, True),
]
TPS = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
DCPS = [0, 1, 2, 3, 4, 8]
PPS = [1, 2, 0]
INTERLEAVES = [1, 4, 16, 32, 0]
BLOCKS = [16, 64]
WINDOWS = [None, 4096]


def grid():
    for (H, kv, mla), tp, dcp, pp, inter, bs, sw in itertools.product(
        MODELS, TPS, DCPS, PPS, INTERLEAVES, BLOCKS, WINDOWS
    ):
        # Keep the grid affordable on a shared 2-core box: vary pp / block / window only around the DCP cases.
        if pp != 1 and (inter, bs, sw) != (1, 16, None):
            continue
        yield ModelParallelInfo(H, kv, mla, sw), ParallelConfig(tp, dcp, pp, inter, bs)


GRID = list(grid())


def test_rule_table_matches_module():
    assert [r for r, _ in RULES] == [
        "positive_sizes",
        "tp_divisible_by_dcp",
        "heads_divisible_by_tp",
        "dcp_tp_gt_kv_heads",
        "dcp_max_size",
        "dcp_q_per_kv",
        "interleave_block_size",
        "kv_heads_split",
        "dcp_group_kv_head",
        "dcp_sliding_window",
    ]


def test_grid_against_reference():
    seen_rules = set()
    n_valid = 0
    for model, cfg in GRID:
        want = ref_of(model, cfg)
        got = check_parallel_config(model, cfg)
        assert isinstance(got, Verdict)
        if want is None:
            assert got.valid, (model, cfg, got)
            assert got.fix is None and got.rule is None
            assert got.message.startswith("valid: ")
            n_valid += 1
        else:
            assert not got.valid, (model, cfg)
            assert (got.rule, got.message) == want, (model, cfg)
            assert isinstance(got.fix, Fix)
            seen_rules.add(got.rule)
    # The grid really exercises every rule, and has valid configs too.
    assert seen_rules == {r for r, _ in RULES}
    assert n_valid > 50


def test_fix_always_yields_valid_config_on_grid():
    for model, cfg in GRID:
        v = check_parallel_config(model, cfg)
        if v.valid:
            continue
        fixed = v.fix.apply(cfg)
        assert ref_of(model, fixed) is None, (model, cfg, v.fix, ref_of(model, fixed))
        # The fix names real flags and its cli form round-trips.
        assert v.fix.flag in v.fix.changes and v.fix.changes[v.fix.flag] == v.fix.value
        assert len(v.fix.cli_args) == 2 * len(v.fix.changes)
        assert v.fix.text and v.fix.text.endswith(".")


def brute_smallest_tp(model, cfg):
    """Smallest TP >= requested making the whole config valid (others unchanged), brute force."""
    for tp in range(cfg.tensor_parallel_size, 4 * model.num_attention_heads + 1):
        if ref_of(model, ParallelConfig(tp, *_rest(cfg))) is None:
            return tp
    return None


def _rest(cfg):
    return (
        cfg.decode_context_parallel_size,
        cfg.pipeline_parallel_size,
        cfg.dcp_kv_cache_interleave_size,
        cfg.block_size,
    )


def brute_largest_dcp_below(model, cfg):
    for d in range(cfg.decode_context_parallel_size - 1, 1, -1):
        c = ParallelConfig(
            cfg.tensor_parallel_size, d, cfg.pipeline_parallel_size, cfg.dcp_kv_cache_interleave_size, cfg.block_size
        )
        if ref_of(model, c) is None:
            return d
    return None


def test_fix_is_the_honest_one_on_grid():
    """Single-flag fixes are what they claim to be: smallest TP at/above, largest DCP below, or DCP 1 when
    neither exists."""
    checked = 0
    for model, cfg in GRID:
        v = check_parallel_config(model, cfg)
        if v.valid or v.rule == "positive_sizes" or v.fix.also:
            continue
        if (
            v.rule in ("dcp_tp_gt_kv_heads", "heads_divisible_by_tp", "kv_heads_split")
            and v.fix.flag == "--tensor-parallel-size"
        ):
            if v.fix.value >= cfg.tensor_parallel_size:
                assert v.fix.value == brute_smallest_tp(model, cfg), (model, cfg, v.fix)
                checked += 1
        if v.rule in ("dcp_max_size", "dcp_q_per_kv", "tp_divisible_by_dcp", "dcp_group_kv_head"):
            best = brute_largest_dcp_below(model, cfg)
            if best is not None:
                assert (v.fix.flag, v.fix.value) == ("--decode-context-parallel-size", best), (model, cfg, v.fix)
                checked += 1
        if v.fix.flag == "--decode-context-parallel-size" and v.fix.value == 1 and v.rule != "dcp_sliding_window":
            # DCP 1 is only offered when no TP (at/above) keeps DCP working and no smaller DCP works.
            assert brute_largest_dcp_below(model, cfg) is None
            assert brute_smallest_tp(model, cfg) is None, (model, cfg, v.fix)
            checked += 1
    assert checked > 100


# --------------------------------------------------------------------------------------------------------------
# Specific cases: the TP 8 x DCP 2 example, each message, order
# --------------------------------------------------------------------------------------------------------------


def test_example_tp8_dcp2_8kv_heads():
    # Example: "before (8 KV heads) --tensor-parallel-size 8 --decode-context-parallel-size 2; after: TP 16".
    model = ModelParallelInfo(num_attention_heads=32, num_kv_heads=8)
    cfg = ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=2)
    v = check_parallel_config(model, cfg)
    assert not v.valid
    assert v.message == (
        "Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (8) to be greater than the "
        "model's total number of KV heads (8). Increase `--tensor-parallel-size` or set "
        "`--decode-context-parallel-size 1`."
    )
    assert v.fix == Fix(
        flag="--tensor-parallel-size",
        value=16,
        text="Use `--tensor-parallel-size 16` (the smallest valid value at or above the requested 8).",
    )
    assert check_parallel_config(model, v.fix.apply(cfg)).valid


def test_max_dcp_message_and_fix():
    model = ModelParallelInfo(32, 8)
    v = check_parallel_config(model, ParallelConfig(16, 4))
    assert v.rule == "dcp_max_size"
    assert v.message == (
        "`--decode-context-parallel-size` (4) exceeds the maximum supported value (2) for "
        "`--tensor-parallel-size` (16) and 8 model KV heads."
    )
    assert (v.fix.flag, v.fix.value, v.fix.also) == ("--decode-context-parallel-size", 2, ())


def test_q_per_kv_message():
    # 24 heads / 2 KV heads = 12 per KV head; TP 24? heads%24 ok; max dcp = 12; dcp 8 does not divide 12.
    model = ModelParallelInfo(24, 2)
    v = check_parallel_config(model, ParallelConfig(24, 8))
    assert v.rule == "dcp_q_per_kv"
    assert v.message == (
        "The model's number of query heads per KV head (12) must be divisible by "
        "`--decode-context-parallel-size` (8) for GQA/MQA."
    )
    assert (v.fix.flag, v.fix.value) == ("--decode-context-parallel-size", 6)  # 6 | 24, 6 <= 12, 12 % 6 == 0


def test_tp_dcp_and_heads_messages():
    m = ModelParallelInfo(32, 8)
    assert check_parallel_config(m, ParallelConfig(6, 4)).message == "tp_size=6 must be divisible by dcp_size=4."
    assert check_parallel_config(m, ParallelConfig(12, 1)).message == (
        "Total number of attention heads (32) must be divisible by tensor parallel size (12)."
    )


def test_interleave_message_and_fix():
    m = ModelParallelInfo(32, 8)
    v = check_parallel_config(m, ParallelConfig(16, 2, dcp_kv_cache_interleave_size=24, block_size=16))
    assert v.message == (
        "Block_size(16) should be greater than or equal to and divisible by cp_kv_cache_interleave_size (24)."
    )
    assert (v.fix.flag, v.fix.value) == ("--dcp-kv-cache-interleave-size", 16)
    v = check_parallel_config(m, ParallelConfig(16, 2, dcp_kv_cache_interleave_size=3, block_size=16))
    assert v.rule == "interleave_block_size" and v.fix.value == 2
    # vLLM only checks the interleave when DCP > 1.
    assert check_parallel_config(m, ParallelConfig(8, 1, dcp_kv_cache_interleave_size=24)).valid


def test_mla_only_divisibility_applies():
    mla = ModelParallelInfo(num_attention_heads=16, num_kv_heads=16, use_mla=True)
    assert check_parallel_config(mla, ParallelConfig(8, 8)).valid  # TP <= KV heads is fine for MLA
    assert check_parallel_config(mla, ParallelConfig(2, 2)).valid
    assert check_parallel_config(mla, ParallelConfig(8, 3)).rule == "tp_divisible_by_dcp"
    gqa = ModelParallelInfo(16, 16)
    assert check_parallel_config(gqa, ParallelConfig(8, 8)).rule == "dcp_tp_gt_kv_heads"


def test_mha_with_dcp_can_only_be_fixed_by_dcp_1():
    # MHA: TP must divide H and exceed H at the same time -> impossible; the fix must turn DCP off.
    m = ModelParallelInfo(32, 32)
    v = check_parallel_config(m, ParallelConfig(8, 2))
    assert v.rule == "dcp_tp_gt_kv_heads"
    assert (v.fix.flag, v.fix.value, v.fix.also) == ("--decode-context-parallel-size", 1, ())
    assert "turn decode context parallelism off" in v.fix.text


def test_sliding_window_refused_with_dcp_only():
    m = ModelParallelInfo(32, 8, sliding_window=4096)
    v = check_parallel_config(m, ParallelConfig(16, 2))
    assert (v.rule, v.message) == ("dcp_sliding_window", "DCP not support sliding window.")
    assert (v.fix.flag, v.fix.value) == ("--decode-context-parallel-size", 1)
    assert check_parallel_config(m, ParallelConfig(16, 1)).valid


def test_positive_sizes():
    m = ModelParallelInfo(32, 8)
    v = check_parallel_config(m, ParallelConfig(pipeline_parallel_size=0))
    assert v.message == "`--pipeline-parallel-size` must be a positive integer (>= 1), got 0."
    assert (v.fix.flag, v.fix.value) == ("--pipeline-parallel-size", 1)
    v = check_parallel_config(m, ParallelConfig(tensor_parallel_size=-2))
    assert v.message == "`--tensor-parallel-size` must be a positive integer (>= 1), got -2."
    assert (v.fix.flag, v.fix.value) == ("--tensor-parallel-size", 1)
    v = check_parallel_config(m, ParallelConfig(block_size=0))
    assert v.message == "`--block-size` must be a positive integer (>= 1), got 0."
    v = check_parallel_config(m, ParallelConfig(tensor_parallel_size=True))  # bool is not a size
    assert v.rule == "positive_sizes"
    v = check_parallel_config(m, ParallelConfig(tensor_parallel_size=2.0))
    assert v.message == "`--tensor-parallel-size` must be a positive integer (>= 1), got 2.0."
    # Several bad fields: first reported in order, fix repairs all of them.
    cfg = ParallelConfig(
        tensor_parallel_size=0,
        decode_context_parallel_size=0,
        pipeline_parallel_size=0,
        dcp_kv_cache_interleave_size=0,
        block_size=0,
    )
    v = check_parallel_config(m, cfg)
    assert v.message.startswith("`--pipeline-parallel-size`")
    assert check_parallel_config(m, v.fix.apply(cfg)).valid
    assert len(v.fix.changes) == 5


def test_order_first_failing_rule_wins():
    m = ModelParallelInfo(32, 8, sliding_window=128)
    # tp%dcp and heads%tp and dcp rules and sliding window all fail -> tp%dcp (ParallelConfig) first.
    assert check_parallel_config(m, ParallelConfig(6, 4, dcp_kv_cache_interleave_size=64)).rule == "tp_divisible_by_dcp"
    # heads%tp before the DCP GQA rules.
    assert check_parallel_config(m, ParallelConfig(12, 2)).rule == "heads_divisible_by_tp"
    # GQA rules before interleave, interleave before sliding window.
    assert check_parallel_config(m, ParallelConfig(8, 2, dcp_kv_cache_interleave_size=64)).rule == "dcp_tp_gt_kv_heads"
    assert (
        check_parallel_config(m, ParallelConfig(16, 2, dcp_kv_cache_interleave_size=64)).rule == "interleave_block_size"
    )


def test_kv_heads_split_rule():
    m = ModelParallelInfo(24, 6)  # 4 query heads per KV head
    v = check_parallel_config(m, ParallelConfig(4, 1))  # 24 % 4 == 0 but 6 KV heads over 4 ranks is uneven
    assert v.rule == "kv_heads_split"
    assert (v.fix.flag, v.fix.value) == ("--tensor-parallel-size", 6)
    assert check_parallel_config(m, ParallelConfig(12, 2)).valid  # 2 replicas per KV head, DCP 2 inside them


def test_dcp_group_must_share_a_kv_head():
    # vLLM's three GQA checks pass (12 > 2, 4 <= 6, 12 % 4 == 0) but ranks 4..7 would hold KV heads 0,0,1,1.
    m = ModelParallelInfo(24, 2)
    assert [kv_heads_for_tp_rank(2, 12, r)[0] for r in dcp_group_ranks(4, 4)] == [0, 0, 1, 1]
    v = check_parallel_config(m, ParallelConfig(12, 4))
    assert v.rule == "dcp_group_kv_head"
    assert v.message == (
        "`--decode-context-parallel-size` (4) must divide the number of TP ranks per KV head "
        "(`--tensor-parallel-size` 12 // 2 KV heads = 6) so that every decode context parallel group holds "
        "the same KV head."
    )
    assert (v.fix.flag, v.fix.value) == ("--decode-context-parallel-size", 3)
    assert check_parallel_config(m, ParallelConfig(12, 3)).valid
    assert check_parallel_config(m, ParallelConfig(8, 4)).valid


def test_multi_flag_fix_when_one_flag_is_not_enough():
    # Sliding window + TP that does not divide the heads: needs TP changed AND DCP off.
    m = ModelParallelInfo(32, 8, sliding_window=4096)
    cfg = ParallelConfig(12, 2)
    v = check_parallel_config(m, cfg)
    assert v.rule == "heads_divisible_by_tp"
    assert v.fix.flag == "--tensor-parallel-size"
    assert v.fix.changes == {"--tensor-parallel-size": 16, "--decode-context-parallel-size": 1}
    assert check_parallel_config(m, v.fix.apply(cfg)).valid
    assert v.fix.cli_args == ["--tensor-parallel-size", "16", "--decode-context-parallel-size", "1"]


def test_validate_raises_parallel_config_error():
    m = ModelParallelInfo(32, 8)
    assert validate_parallel_config(m, ParallelConfig(16, 2)) is None
    with pytest.raises(ParallelConfigError) as ei:
        validate_parallel_config(m, ParallelConfig(8, 2))
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.message.startswith("Decode context parallelism for GQA/MQA requires")
    assert err.fix.value == 16 and err.rule == "dcp_tp_gt_kv_heads"
    assert err.message in str(err) and err.fix.text in str(err)


@settings(max_examples=300, deadline=None)
@given(
    H_per_kv=st.integers(1, 16),
    kv=st.sampled_from([1, 2, 3, 4, 8, 16]),
    mla=st.booleans(),
    sw=st.sampled_from([None, 1024]),
    tp=st.integers(-1, 40),
    dcp=st.integers(0, 16),
    pp=st.integers(0, 4),
    inter=st.integers(0, 40),
    bs=st.sampled_from([0, 1, 8, 16, 32, 48]),
)
def test_property_matches_reference_and_fix_works(H_per_kv, kv, mla, sw, tp, dcp, pp, inter, bs):
    model = ModelParallelInfo(H_per_kv * kv, kv, mla, sw)
    cfg = ParallelConfig(tp, dcp, pp, inter, bs)
    v = check_parallel_config(model, cfg)
    want = ref_of(model, cfg)
    assert (None if v.valid else (v.rule, v.message)) == want
    if not v.valid:
        assert ref_of(model, v.fix.apply(cfg)) is None, (model, cfg, v.fix)


# --------------------------------------------------------------------------------------------------------------
# ModelParallelInfo from HF configs
# --------------------------------------------------------------------------------------------------------------


def test_from_hf_config_variants():
    llama = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 8}
    assert ModelParallelInfo.from_hf_config(llama) == ModelParallelInfo(32, 8, False, None)
    assert ModelParallelInfo.from_hf_config(llama).kind == "GQA"
    mha = {"num_attention_heads": 12}  # no num_key_value_heads -> MHA
    assert ModelParallelInfo.from_hf_config(mha) == ModelParallelInfo(12, 12)
    assert ModelParallelInfo.from_hf_config({"num_attention_heads": 12, "num_key_value_heads": None}).kind == "MHA"
    deepseek = {
        "model_type": "deepseek_v2",
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
    }
    ds = ModelParallelInfo.from_hf_config(deepseek)
    assert ds.use_mla and ds.kind == "MLA"
    assert not ModelParallelInfo.from_hf_config({"num_attention_heads": 8, "kv_lora_rank": None}).use_mla
    qwen2 = {"num_attention_heads": 28, "num_key_value_heads": 4, "sliding_window": 131072, "use_sliding_window": False}
    assert ModelParallelInfo.from_hf_config(qwen2).sliding_window is None
    qwen2_on = dict(qwen2, use_sliding_window=True)
    assert ModelParallelInfo.from_hf_config(qwen2_on).sliding_window == 131072
    mistral = {"num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096}
    assert ModelParallelInfo.from_hf_config(mistral).sliding_window == 4096
    assert ModelParallelInfo.from_hf_config(dict(mistral, sliding_window=None)).sliding_window is None
    falcon = {"n_head": 71, "multi_query": True}
    assert ModelParallelInfo.from_hf_config(falcon) == ModelParallelInfo(71, 1)
    wrapped = {"architectures": ["X"], "text_config": {"num_attention_heads": 16, "num_key_value_heads": 4}}
    assert ModelParallelInfo.from_hf_config(wrapped) == ModelParallelInfo(16, 4)


def test_from_hf_config_rejects_impossible_models():
    with pytest.raises(ValueError):
        ModelParallelInfo.from_hf_config({})
    with pytest.raises(ValueError):
        ModelParallelInfo.from_hf_config({"num_attention_heads": 32, "num_key_value_heads": 6})
    with pytest.raises(ValueError):
        ModelParallelInfo(0, 1)
    with pytest.raises(ValueError):
        ModelParallelInfo(8, 0)


def test_from_model_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8}))
    assert ModelParallelInfo.from_model_path(tmp_path) == ModelParallelInfo(32, 8)
    assert ModelParallelInfo.from_model_path(tmp_path / "config.json") == ModelParallelInfo(32, 8)
    with pytest.raises(FileNotFoundError):
        ModelParallelInfo.from_model_path(tmp_path / "missing")


# --------------------------------------------------------------------------------------------------------------
# Layout helpers
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dcp", [1, 2, 3, 4])
@pytest.mark.parametrize("interleave", [1, 2, 3, 5, 16])
def test_token_layout_is_a_dense_partition(dcp, interleave):
    for n in list(range(0, 70)) + [257, 1000]:
        per_rank: dict[int, list[int]] = {r: [] for r in range(dcp)}
        for t in range(n):
            owner = dcp_owner(t, dcp, interleave)
            assert 0 <= owner < dcp
            per_rank[owner].append(dcp_local_index(t, dcp, interleave))
        total = 0
        for r in range(dcp):
            count = dcp_local_count(n, dcp, interleave, r)
            # Each token owned by exactly one rank; local indices dense 0..count-1 and in token order.
            assert per_rank[r] == list(range(count))
            total += count
            for bs in (1, 4, 16):
                assert dcp_local_num_blocks(n, dcp, interleave, r, bs) == -(-count // bs)
        assert total == n


def test_token_layout_examples():
    # interleave 1: token i on rank i % dcp (vLLM's docstring).
    assert [dcp_owner(t, 4, 1) for t in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [dcp_local_index(t, 4, 1) for t in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # interleave 2, dcp 2: 0,1 -> r0; 2,3 -> r1; 4,5 -> r0 (local 2,3) ...
    assert [dcp_owner(t, 2, 2) for t in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dcp_local_index(t, 2, 2) for t in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert [dcp_local_count(5, 2, 2, r) for r in range(2)] == [3, 2]


def test_dcp_groups():
    assert [dcp_rank_of(r, 2) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert dcp_group_ranks(5, 2) == [4, 5]
    assert dcp_group_ranks(5, 4) == [4, 5, 6, 7]
    assert dcp_group_ranks(3, 1) == [3]
    for tp, dcp in [(8, 2), (16, 4), (12, 3)]:
        groups = {tuple(dcp_group_ranks(r, dcp)) for r in range(tp)}
        assert sorted(r for g in groups for r in g) == list(range(tp))
        for r in range(tp):
            assert dcp_group_ranks(r, dcp)[dcp_rank_of(r, dcp)] == r


def test_head_layout_examples():
    assert [kv_heads_for_tp_rank(8, 4, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [kv_heads_for_tp_rank(8, 16, r) for r in range(16)] == [[r // 2] for r in range(16)]
    assert num_local_kv_heads(8, 16) == 1 and num_local_kv_heads(8, 2) == 4
    assert q_heads_for_tp_rank(32, 4, 1) == list(range(8, 16))
    with pytest.raises(ValueError):
        kv_heads_for_tp_rank(6, 4, 0)
    with pytest.raises(ValueError):
        q_heads_for_tp_rank(32, 12, 0)
    with pytest.raises(ValueError):
        kv_heads_for_tp_rank(8, 4, 4)


def test_head_layout_consistent_with_every_valid_grid_config():
    """For valid non-MLA configs: every query head's KV head lives on the same rank; KV heads are all covered;
    the ranks of one DCP group hold the same KV head(s)."""
    checked = 0
    for model, cfg in GRID:
        if model.use_mla or not check_parallel_config(model, cfg).valid:
            continue
        H, kv, tp, dcp = (
            model.num_attention_heads,
            model.num_kv_heads,
            cfg.tensor_parallel_size,
            cfg.decode_context_parallel_size,
        )
        group = H // kv
        covered_q, covered_kv = [], set()
        for r in range(tp):
            qs = q_heads_for_tp_rank(H, tp, r)
            kvs = kv_heads_for_tp_rank(kv, tp, r)
            assert len(kvs) == num_local_kv_heads(kv, tp)
            assert {q // group for q in qs} <= set(kvs)
            covered_q += qs
            covered_kv |= set(kvs)
            for peer in dcp_group_ranks(r, dcp):
                assert kv_heads_for_tp_rank(kv, tp, peer) == kvs
        assert covered_q == list(range(H))
        assert covered_kv == set(range(kv))
        checked += 1
    assert checked > 20


def test_layout_helpers_reject_bad_arguments():
    for bad in (
        lambda: dcp_owner(-1, 2, 1),
        lambda: dcp_owner(0, 0, 1),
        lambda: dcp_local_index(3, 2, 0),
        lambda: dcp_local_count(5, 2, 1, 2),
        lambda: dcp_rank_of(-1, 2),
        lambda: dcp_group_ranks(0, 0),
        lambda: dcp_local_num_blocks(5, 2, 1, 0, 0),
    ):
        with pytest.raises(ValueError):
            bad()
