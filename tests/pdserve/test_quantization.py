"""--quantization int8 (pdserve/model/quant.py): block-wise (Q8_0) weight quantisation at load that every TP split
shares, refused where a split would cut a block, per-channel compressed-tensors checkpoints, the flag's validation,
and int8 engines on Llama and DeepSeek (MLA + MoE) checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from decode_svc.config import DecodeConfig
from pdserve import cli_config, kernels
from pdserve.attention import select_backend
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model import quant
from pdserve.model.config import ModelConfig, ModelConfigError
from pdserve.model.parallel_state import ParallelState
from pdserve.model.registry import build_model
from pdserve.model.weights import load_weights
from pdserve.sampling_params import SamplingParams
from pdserve.testing import write_w8a8_checkpoint
from prefill_svc.config import PrefillConfig

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="pdserve's CPU kernels are unavailable")


def test_quantize_per_channel_rounds_each_row_to_its_own_scale():
    w = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)) * torch.tensor([1, 100, 1e-3, 0, 7])[:, None]
    q, s = quant.quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (5,)
    assert q.abs().amax(dim=1).tolist() == [127, 127, 127, 0, 127] and s[3].item() == 1.0
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()


def test_quantize_per_group_rounds_each_block_of_a_row_to_its_own_scale_with_a_short_last_block():
    w = torch.randn(3, 70, generator=torch.Generator().manual_seed(0))
    w[1, 32:64] *= 100
    w[2, 64:] = 0
    q, s = quant.quantize_per_group(w)
    assert q.shape == (3, 70) and s.shape == (3, 3)
    for g, (c0, c1) in enumerate([(0, 32), (32, 64), (64, 70)]):
        qb, sb = quant.quantize_per_channel(w[:, c0:c1])
        assert torch.equal(q[:, c0:c1], qb) and torch.equal(s[:, g], sb), g
    assert s[2, 2].item() == 1.0


def _int8_model(path, tp: int, rank: int, group: int = quant.GROUP):
    cfg = ModelConfig.from_path(path)
    model = build_model(cfg, ParallelState(tp_size=tp, tp_rank=rank), select_backend("cpu"), max_positions=64)
    quant.make_int8(model, group=group)
    load_weights(model, path)
    return model


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("group", [quant.GROUP, 0])
@pytest.mark.parametrize("tp", [2, 3])
def test_every_tp_split_holds_the_int8_values_and_scales_of_the_whole_weight(tiny_factory, tp, group):
    # six heads of 32 split 3 / 2 per rank and 192 columns 96 / 64: row-parallel shards hold whole blocks
    path = tiny_factory("llama", num_heads=6, num_kv_heads=6, head_dim=32, hidden_size=192, intermediate_size=192)
    whole = _int8_model(path, 1, 0, group)
    ranks = [_int8_model(path, tp, r, group) for r in range(tp)]
    with safe_open(str(path / "model.safetensors"), framework="pt") as st:
        w_full = st.get_tensor("model.layers.1.mlp.down_proj.weight")
    q, s = quant.quantize_per_group(w_full) if group else quant.quantize_per_channel(w_full)
    assert torch.equal(whole.layers[1].mlp.down_weight, q) and torch.equal(whole.layers[1].mlp.down_weight_scale, s)
    for i, layer in enumerate(whole.layers):
        parts = [r.layers[i] for r in ranks]
        # row parallel (o, down): columns split with their blocks' scales, or every rank keeps the per-row scales
        for mod, name in [("self_attn", "o_weight"), ("mlp", "down_weight")]:
            w, s = _weight(layer, mod, name)
            assert torch.equal(torch.cat([_weight(p, mod, name)[0] for p in parts], dim=1), w), (i, name)
            if group:
                assert torch.equal(torch.cat([_weight(p, mod, name)[1] for p in parts], dim=1), s), (i, name)
            else:
                assert all(torch.equal(_weight(p, mod, name)[1], s) for p in parts), (i, name)
        # column parallel (gate/up, q/k/v): rows split with their scales
        for cut in (_gate, _up, _q, _k, _v):
            for t in range(2):  # the weight, then its scales
                got = torch.cat([cut(p)[t] for p in parts])
                assert torch.equal(got, cut(layer)[t]), (i, cut.__name__)


@needs_kernels
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_each_rank_holds_the_q8_0_rows_of_its_lm_head_shard(tiny_factory, tp):
    # uneven vocab shards (250 rows over 3 ranks)
    path = tiny_factory(
        "llama", num_heads=6, num_kv_heads=6, head_dim=32, hidden_size=192, intermediate_size=192, vocab_size=250
    )
    q, s = quant.quantize_per_group(_int8_model(path, 1, 0).lm_head.detach())
    heads = []
    for r in range(tp):
        model = _int8_model(path, tp, r)
        model.pack_weights()
        quant.quantize_lm_head(model)
        heads.append(model.lm_head_packed)
    assert torch.equal(torch.cat([h.qweight for h in heads]), q)
    assert torch.equal(torch.cat([h.scale for h in heads]), s)


@needs_kernels
def test_a_tp_split_that_cuts_a_block_is_refused_with_what_to_use(tiny_factory):
    # down_proj's 130 columns split 65 / 65: the second rank's first block would start mid-block
    path = tiny_factory("llama", num_heads=4, num_kv_heads=2, hidden_size=128, intermediate_size=130)
    with pytest.raises(ModelConfigError, match=r"blocks of 32 input columns.*shards of 65"):
        _int8_model(path, 2, 0)
    assert _int8_model(path, 1, 0).layers[0].mlp.down_weight_scale.shape == (128, 5)  # 4 blocks + a short one


def _weight(layer, mod: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    m = getattr(layer, mod)
    return getattr(m, name), getattr(m, name + "_scale")


def _rows(layer, mod: str, name: str, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    w, s = _weight(layer, mod, name)
    return w[first : first + n], s[first : first + n]


def _gate(layer):
    return _rows(layer, "mlp", "gate_up_weight", 0, layer.mlp.inter)


def _up(layer):
    return _rows(layer, "mlp", "gate_up_weight", layer.mlp.inter, layer.mlp.inter)


def _q(layer):
    return _rows(layer, "self_attn", "qkv_weight", 0, layer.self_attn.q_size)


def _k(layer):
    a = layer.self_attn
    return _rows(layer, "self_attn", "qkv_weight", a.q_size, a.kv_size)


def _v(layer):
    a = layer.self_attn
    return _rows(layer, "self_attn", "qkv_weight", a.q_size + a.kv_size, a.kv_size)


def test_bad_quantization_values_say_what_to_use():
    with pytest.raises(ValueError, match=r"quantization must be one of none, int8, got 'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="drop one of the two"):
        EngineConfig(quantization="int8", exact_prefill=True)


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig])
def test_both_pods_take_the_quantization_flag(cls, capsys):
    parser = cli_config.build_parser(cls, "test", environ={})
    cfg = cli_config.from_args(cls, parser.parse_args(["--quantization", "int8"]))
    assert cfg.engine.quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def _prompt_logprobs(path, quantization: str, prompt: list[int]) -> list[float]:
    cfg = EngineConfig(model=str(path), quantization=quantization, num_kv_blocks=64, enable_prefix_caching=False)
    with LLMEngine(cfg) as eng:
        res = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=4), prompt_logprobs=0)[0]
        assert len(res["token_ids"]) == 4
    return [lp[0] for lp in res["prompt_logprobs"] if lp is not None and lp[0] is not None]


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize(
    "family,shape",
    [("llama", dict(num_heads=4, num_kv_heads=2, intermediate_size=96)), ("deepseek_v3", dict(num_heads=4))],
)
def test_int8_engine_scores_prompts_close_to_full_precision(tiny_factory, family, shape):
    path = tiny_factory(family, **shape)
    prompt = [(i * 37 + 5) % 250 + 3 for i in range(40)]
    ref, got = _prompt_logprobs(path, "none", prompt), _prompt_logprobs(path, "int8", prompt)
    assert len(got) == len(ref) == len(prompt) - 1
    # perplexity within a few percent on a random model, whose logits int8 error moves more than a trained one's
    assert abs(math.exp(-sum(got) / len(got)) / math.exp(-sum(ref) / len(ref)) - 1) < 0.05


@needs_kernels
@pytest.mark.parametrize("tp", [1, 2])
def test_a_w8a8_checkpoint_loads_the_int8_weights_that_per_channel_quantising_at_load_makes(tiny_factory, tp, tmp_path):
    src = tiny_factory("llama", num_heads=4, num_kv_heads=2, intermediate_size=96)
    ct = write_w8a8_checkpoint(src, tmp_path / "w8a8")
    cfg = ModelConfig.from_path(ct)
    assert quant.checkpoint_int8(cfg)
    for rank in range(tp):  # per channel, as the checkpoint stores its scales
        ours, theirs = _int8_model(src, tp, rank, group=0), _int8_model(ct, tp, rank, group=0)
        for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert torch.equal(a, b), name


def test_other_quantised_checkpoints_are_refused_with_what_pdserve_reads(tiny_factory, tmp_path):
    cfg = ModelConfig.from_path(tiny_factory("llama"))
    cfg.raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ModelConfigError, match="pdserve loads compressed-tensors W8A8 checkpoints"):
        quant.checkpoint_int8(cfg)


@needs_kernels
@pytest.mark.slow
def test_smollm2_as_a_w8a8_checkpoint_loads_its_per_channel_scales_into_an_engine_that_generates(
    smollm2_path, tmp_path
):
    ct = write_w8a8_checkpoint(smollm2_path, tmp_path / "smollm2-w8a8")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cfg = EngineConfig(model=str(ct), quantization="none", num_kv_blocks=64, enable_prefix_caching=False)
    # block scales ([N, K / 32]) could not take the checkpoint's [N, 1] weight_scale: loading proves per channel
    with LLMEngine(cfg) as eng:
        outs = [r["token_ids"] for r in eng.generate(["The capital of France is", "def add(a, b):"], sp)]
    assert [len(o) for o in outs] == [12, 12]
