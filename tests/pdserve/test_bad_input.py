"""Bad checkpoints, prompts and sampling parameters each give a clear error that says what to change."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.llm_engine import EngineConfig, LLMEngine, RequestError
from pdserve.model.config import ModelConfig, ModelConfigError
from pdserve.sampling_params import SamplingParams, SamplingParamsError


@pytest.fixture()
def tiny_copy(tiny_factory, tmp_path):
    src = tiny_factory("llama", num_heads=4, num_kv_heads=2)
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named(tiny_copy):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_path(tiny_copy)


def test_unsupported_rope_scaling_is_named():
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "longrope"},
    }
    with pytest.raises(ModelConfigError, match="rope scaling type 'longrope'"):
        ModelConfig.from_dict(raw)


def test_missing_tensor_names_file_and_key(tiny_copy):
    f = tiny_copy / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, f)
    missing = r"missing tensor\(s\) 'model.layers.1.mlp.down_proj.weight'.*model.safetensors"
    with pytest.raises(ModelConfigError, match=missing):
        LLMEngine(EngineConfig(model=str(tiny_copy), num_kv_blocks=8))


def test_misshaped_tensor_names_file_key_and_shapes(tiny_copy):
    f = tiny_copy / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 64)
    save_file(tensors, f)
    with pytest.raises(
        ModelConfigError,
        match=r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' "
        r"has shape \[5, 64\], expected \[32, 64\]",
    ):
        LLMEngine(EngineConfig(model=str(tiny_copy), num_kv_blocks=8))


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelConfigError, match="config.json: not found"):
        ModelConfig.from_path(tmp_path)


@pytest.fixture(scope="module")
def engine(tiny_factory):
    eng = LLMEngine(
        EngineConfig(model=str(tiny_factory("llama", num_heads=4, num_kv_heads=2)), num_kv_blocks=16, max_model_len=64)
    )
    yield eng
    eng.shutdown()


def test_prompt_longer_than_max_model_len(engine):
    with pytest.raises(RequestError, match="prompt has 80 tokens but max_model_len is 64"):
        engine.add_request(list(range(80)))
    assert not engine.has_unfinished()


def test_empty_prompt_and_out_of_range_ids(engine):
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.add_request([])
    with pytest.raises(RequestError, match=r"token id 256 is out of range \[0, 256\)"):
        engine.add_request([1, 256])
    with pytest.raises(RequestError, match="out of range"):
        engine.add_request([-1])


def test_duplicate_request_id(engine):
    engine.add_request([1, 2], SamplingParams(max_tokens=1), request_id="dup")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([1, 2], request_id="dup")
    engine.abort("dup")


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(temperature=-1), "temperature must be"),
        (dict(temperature=float("nan")), "temperature must be"),
        (dict(top_p=0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-5), "top_k must be"),
        (dict(max_tokens=0), "max_tokens must be"),
        (dict(seed=-3), "seed must be"),
        (dict(stop=[""]), "stop strings must be non-empty"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be"),
    ],
)
def test_invalid_sampling_params(kwargs, msg):
    with pytest.raises(SamplingParamsError, match=msg):
        SamplingParams(**kwargs)


def test_engine_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="prefill_chunk_size must not exceed max_num_batched_tokens"):
        EngineConfig(prefill_chunk_size=8192, max_num_batched_tokens=4096)


def test_invalid_parallel_config_refused_with_vllm_message(tiny_factory):
    from pdserve.parallel_config import ParallelConfigError

    path = tiny_factory("llama", num_heads=8, num_kv_heads=2)
    with pytest.raises(ParallelConfigError, match="Decode context parallelism for GQA/MQA requires"):
        LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=2, decode_context_parallel_size=2))
