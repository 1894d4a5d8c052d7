"""DeepSeek-V2/V3 (MLA + MoE) against transformers on tiny random checkpoints it writes: fp32 prefill logits within
1e-4 (expanded MLA), greedy tokens identical for 32 tokens single and batched through LLMEngine (absorbed MLA decode
over the paged latent cache), at TP 1 and under TP / DCP."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import hf_greedy

from pdserve.engine.kv_cache import KVCacheLayout
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.model.config import ModelConfig, ModelConfigError
from pdserve.sampling_params import SamplingParams
from tests.pdserve.test_model_reference import PROMPTS, full_logits, hf_logits

# DeepSeek's own YaRN (V2 and V3 ship mscale == mscale_all_dim; the softmax scale then grows by mscale_all_dim^2).
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
YARN_ROPE_ONLY = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 1.0}

# Every shape has a dense first layer, MoE after it with one shared expert, 8 experts in 4 groups (testing.py).
DEEPSEEK_SHAPES = {
    "v2-group-limited": ("deepseek_v2", dict(num_heads=4)),
    "v2-lite-greedy-no-qlora": (
        "deepseek_v2",
        dict(num_heads=4, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, n_shared_experts=2),
    ),
    "v2-yarn": ("deepseek_v2", dict(num_heads=4, rope_scaling=YARN)),
    "v3-noaux-tc": ("deepseek_v3", dict(num_heads=4)),
    "v3-no-qlora-yarn": ("deepseek_v3", dict(num_heads=4, q_lora_rank=None, rope_scaling=YARN)),
    "v3-yarn-rope-only-no-norm": ("deepseek_v3", dict(num_heads=4, rope_scaling=YARN_ROPE_ONLY, norm_topk_prob=False)),
    "v3-rope-halves-wide-v": ("deepseek_v3", dict(num_heads=4, rope_interleave=False, v_head_dim=40)),
}

# fp32 through other kernels (flash vs sdpa, absorbed vs expanded, packed GEMM): rounding only, ~1e-5 measured.
MLA_LOGIT_ATOL = 1e-4


@pytest.mark.parametrize("name", list(DEEPSEEK_SHAPES))
def test_deepseek_prefill_logits_match_transformers(tiny_factory, name):
    family, shape = DEEPSEEK_SHAPES[name]
    path = tiny_factory(family, **shape)
    prompt = [(i * 37 + 11) % 256 for i in range(40)]
    want = hf_logits(path, prompt)
    for exact in (False, True):
        diff = (full_logits(path, prompt, exact_prefill=exact) - want).abs().max().item()
        assert diff <= MLA_LOGIT_ATOL, f"{name} exact_prefill={exact}: max |logit diff| {diff}"


# every shape's logits above; greedy decoding of two shapes in the quick run, of all in the full suite
QUICK_GREEDY = ("v2-group-limited", "v2-lite-greedy-no-qlora")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n in QUICK_GREEDY else [pytest.mark.slow]) for n in DEEPSEEK_SHAPES]
)
def test_deepseek_greedy_single_and_batch_match_transformers(tiny_factory, name):
    family, shape = DEEPSEEK_SHAPES[name]
    path = tiny_factory(family, **shape)
    want = hf_greedy(path, PROMPTS, 32)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=128)) as eng:
        alone = [eng.generate([p], sp)[0]["token_ids"] for p in PROMPTS]
        batch = [r["token_ids"] for r in eng.generate(PROMPTS, sp)]  # prompts now hit the prefix cache
        assert eng.blocks.num_free() == 128
    assert alone == want
    assert batch == want


def test_deepseek_chunked_prefill_matches_transformers(tiny_factory):
    path = tiny_factory("deepseek_v3", num_heads=4)
    want = hf_greedy(path, PROMPTS, 32)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cfg = EngineConfig(
        model=str(path),
        block_size=4,
        num_kv_blocks=128,
        prefill_chunk_size=7,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    with LLMEngine(cfg) as eng:
        assert [r["token_ids"] for r in eng.generate(PROMPTS, sp)] == want


def test_deepseek_latent_cache_layout(tiny_factory):
    """One latent row per token per layer, whole on every TP rank; GQA keeps its K/V split by local heads."""
    cfg = ModelConfig.from_path(tiny_factory("deepseek_v3", num_heads=4))
    assert cfg.mla is not None
    mla = KVCacheLayout.for_model(cfg, tp_size=4, block_size=16)
    assert mla.shape(10) == (cfg.num_layers, 10, 16, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    assert mla.bytes_per_block(torch.float32) == 4 * 16 * cfg.num_layers * 40
    gqa = KVCacheLayout.for_model(ModelConfig.from_path(tiny_factory("llama", num_heads=8, num_kv_heads=2)), 2, 16)
    assert gqa.shape(10) == (2, 2, 10, 16, 1, 16)


def _deepseek_v3_raw(**over) -> dict:
    raw = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    }
    return {**raw, **over}


def test_kimi_k2_config_takes_the_deepseek_v3_path():
    cfg = ModelConfig.from_dict(_deepseek_v3_raw(model_type="kimi_k2", routed_scaling_factor=2.827))
    assert cfg.family == "deepseek_v3" and cfg.head_dim == 8
    assert cfg.moe is not None and cfg.moe.topk_method == "noaux_tc" and cfg.moe.routed_scaling_factor == 2.827


def test_unsupported_moe_routing_is_refused():
    with pytest.raises(ModelConfigError, match="topk_method"):
        ModelConfig.from_dict(_deepseek_v3_raw(scoring_func="softmax"))


# tp % dcp == 0 is MLA's only DCP rule: every rank of a DCP group caches 1/dcp of the tokens of the one shared latent.
# chunk: prompts prefilled 7 tokens a step, so later chunks attend over every DCP rank's share of the cache.
TP_DCP = [
    ("deepseek_v3", 2, 1, 1, None),
    ("deepseek_v3", 2, 2, 1, None),
    ("deepseek_v3", 4, 2, 2, 7),
    ("deepseek_v3", 4, 4, 1, None),
    ("deepseek_v3", 4, 4, 4, None),
    ("deepseek_v2", 2, 2, 4, 7),
    ("deepseek_v2", 4, 4, 1, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,dcp,interleave,chunk", TP_DCP)
def test_deepseek_tp_dcp_greedy_matches_transformers(tiny_factory, family, tp, dcp, interleave, chunk):
    # v2 without q_lora and with YaRN, v3 with both: each projection path gets sliced by TP at least once.
    shape = dict(num_heads=4, q_lora_rank=None, rope_scaling=YARN) if family == "deepseek_v2" else dict(num_heads=4)
    path = tiny_factory(family, **shape)
    want = hf_greedy(path, PROMPTS, 32)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cfg = EngineConfig(
        model=str(path),
        block_size=4,
        num_kv_blocks=64,
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        dcp_kv_cache_interleave_size=interleave,
        prefill_chunk_size=chunk or 1024,
        max_num_batched_tokens=16 if chunk else 4096,
    )
    with LLMEngine(cfg) as eng:
        assert eng.generate([PROMPTS[0]], sp)[0]["token_ids"] == want[0]
        assert [r["token_ids"] for r in eng.generate(PROMPTS, sp)] == want
