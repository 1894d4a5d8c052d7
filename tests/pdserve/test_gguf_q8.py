"""A llama.cpp GGUF file as the model path (pdserve/model/gguf_file.py): Q8_0 tensors load as the file's own int8
values and fp16 block scales (rows un-permuted as llama.cpp's converter permuted Q and K), serve the same tokens as
the fp32 checkpoint quantised at load where both quantisations coincide, split over TP ranks as quantised-at-load
weights do, and unsupported tensor types are refused by name.

The files are written here as llama.cpp's convert_hf_to_gguf.py --outtype q8_0 writes them: the gguf package's
writer and Q8_0 quantiser (bit-exact with ggml's), Q/K rows permuted by its LlamaModel.permute, norms in F32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import kernels
from pdserve.attention import select_backend
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model import gguf_file, quant
from pdserve.model.config import ModelConfig, ModelConfigError
from pdserve.model.parallel_state import ParallelState
from pdserve.model.registry import build_model
from pdserve.model.weights import load_weights
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="pdserve's CPU kernels are unavailable")

Q8_0, F32, Q4_1 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q4_1
SHAPE = dict(num_heads=8, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=128, vocab_size=256)
VOCAB = SHAPE["vocab_size"]


def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: Q and K rows reordered for llama.cpp's rope."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    src: Path,
    dst: Path,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """The Llama checkpoint src as a GGUF file: matrices Q8_0 (or types[gguf name]), vectors F32, plus `extra`
    tensors as they are; the tokenizer's first VOCAB tokens (the model's vocabulary) with the merges among them."""
    cfg = json.loads((src / "config.json").read_text())
    nh, nkv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(dst), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tj = json.loads((src / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    special = {a["id"] for a in tj["added_tokens"]}
    tokens = [by_id[i] for i in range(cfg["vocab_size"])]
    known = set(tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([m for m in merges if all(p in known for p in m.split(" ")) and m.replace(" ", "") in known])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template((src / "chat_template.jinja").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    for key, t in load_file(str(src / "model.safetensors")).items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        data = t.float().numpy()
        if key.endswith("q_proj.weight"):
            data = llamacpp_permute(data, nh, nh)
        elif key.endswith("k_proj.weight"):
            data = llamacpp_permute(data, nh, nkv)
        qtype = F32 if data.ndim == 1 else (types or {}).get(name, Q8_0)
        if qtype == F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def file_blocks(path: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's int8 values and fp16 scales, read from the file's bytes as ggml's block_q8_0 struct."""
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    assert t.tensor_type == Q8_0
    blocks = np.frombuffer(t.data.tobytes(), dtype=np.dtype([("d", "<f2"), ("qs", "i1", 32)]))
    rows = t.data.shape[0]
    return blocks["qs"].reshape(rows, -1), blocks["d"].reshape(rows, -1)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' GGUF loader's reverse of llama.cpp's permutation (LlamaTensorProcessor)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def q8_0_exact_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of src whose every matrix is already a Q8_0 grid: each block of 32 is q * 2^-e with int q, |q| <= 127
    and one |q| = 127, so pdserve's quantisation at load and llama.cpp's (fp16 scale, x * (1 / d)) give the same
    int8 values and scales, and de-quantising the file's Q8_0 blocks gives back the fp32 values."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(1)
    out = {}
    for key, t in load_file(str(src / "model.safetensors")).items():
        if t.dim() == 2:
            rows, cols = t.shape
            q = torch.randint(-127, 128, (rows, cols // 32, 32), generator=g).float()
            q[..., 0] = 127 * torch.where(torch.rand(rows, cols // 32, generator=g) < 0.5, -1.0, 1.0)
            d = torch.exp2(-torch.randint(6, 9, (rows, cols // 32, 1), generator=g).float())
            t = (q * d).reshape(rows, cols)
        out[key] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _int8_model(path: Path, tp: int = 1, rank: int = 0):
    cfg = ModelConfig.from_path(path)
    model = build_model(cfg, ParallelState(tp_size=tp, tp_rank=rank), select_backend("cpu"), max_positions=64)
    quant.make_int8(model)
    load_weights(model, path)
    return model


@pytest.fixture(scope="module")
def tied_gguf(tiny_factory, tmp_path_factory) -> tuple[Path, Path]:
    """(fp32 checkpoint with a tied head, its Q8_0 GGUF) from random weights: fp16 scales round as llama.cpp's."""
    src = tiny_factory("llama", tie_word_embeddings=True, **SHAPE)
    return src, write_gguf(src, tmp_path_factory.mktemp("gguf") / "tiny-tied-q8_0.gguf")


@needs_kernels
def test_q8_0_weights_are_the_files_int8_values_and_fp16_scales(tied_gguf):
    src, path = tied_gguf
    cfg = ModelConfig.from_path(path)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.tie_word_embeddings and cfg.vocab_size == VOCAB
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 2, 16)
    model = _int8_model(path)
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    qs, ks = nh * d, nkv * d
    parts = {
        "blk.1.attn_q.weight": (attn.qkv_weight[:qs], attn.qkv_weight_scale[:qs], nh),
        "blk.1.attn_k.weight": (attn.qkv_weight[qs : qs + ks], attn.qkv_weight_scale[qs : qs + ks], nkv),
        "blk.1.attn_v.weight": (attn.qkv_weight[qs + ks :], attn.qkv_weight_scale[qs + ks :], None),
        "blk.1.attn_output.weight": (attn.o_weight, attn.o_weight_scale, None),
        "blk.1.ffn_gate.weight": (mlp.gate_up_weight[: mlp.inter], mlp.gate_up_weight_scale[: mlp.inter], None),
        "blk.1.ffn_up.weight": (mlp.gate_up_weight[mlp.inter :], mlp.gate_up_weight_scale[mlp.inter :], None),
        "blk.1.ffn_down.weight": (mlp.down_weight, mlp.down_weight_scale, None),
    }
    for name, (q, s, heads) in parts.items():
        fq, fd = file_blocks(path, name)
        if heads:
            fq, fd = unpermute(fq, heads), unpermute(fd, heads)
        assert torch.equal(q, torch.from_numpy(fq)), name
        assert torch.equal(s, torch.from_numpy(fd.astype(np.float32))), name
    # the file's fp16 scales, not those of quantising the fp32 weights at load (which keep float32's bits)
    w_down = load_file(str(src / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    assert not torch.equal(mlp.down_weight_scale, quant.quantize_per_group(w_down)[1])
    # the embedding de-quantised exactly, and the tied head the embedding's own Q8_0 blocks
    fq, fd = file_blocks(path, "token_embd.weight")
    deq = fq.astype(np.float32).reshape(VOCAB, -1, 32) * fd.astype(np.float32)[..., None]
    assert torch.equal(model.embed_tokens.detach(), torch.from_numpy(deq.reshape(VOCAB, -1)))
    head = gguf_file.lm_head_q8_0(model, path)
    assert head is not None
    assert torch.equal(head.qweight, torch.from_numpy(fq))
    assert torch.equal(head.scale, torch.from_numpy(fd.astype(np.float32)))


@needs_kernels
def test_tokenizer_and_config_come_from_the_files_metadata(tied_gguf):
    src, path = tied_gguf
    tok, ref = Tokenizer(path), Tokenizer(src)
    assert tok.chat_template == ref.chat_template and (tok.bos_token, tok.eos_token) == (ref.bos_token, ref.eos_token)
    assert tok.vocab_size == VOCAB
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == ref.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode("abc hello")
    assert ids and all(i < VOCAB for i in ids) and tok.decode(ids) == "abc hello"


def _generate(model: str | Path, quantization: str, prompts: list[list[int]], tp: int = 1):
    cfg = EngineConfig(
        model=str(model),
        quantization=quantization,
        tensor_parallel_size=tp,
        num_kv_blocks=64,
        enable_prefix_caching=False,
    )
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLMEngine(cfg) as eng:
        res = eng.generate(prompts, sp)
    return [r["token_ids"] for r in res], [r["logprobs"] for r in res]


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_q8_0_file_serves_the_tokens_and_logprobs_of_its_checkpoint_quantised_at_load(tiny_factory, tmp_path, tp):
    # every matrix already on a Q8_0 grid: both quantisations coincide, so the two engines hold the same bits
    src = q8_0_exact_checkpoint(tiny_factory("llama", **SHAPE), tmp_path / "exact")
    path = write_gguf(src, tmp_path / "exact-q8_0.gguf")
    model, ref = _int8_model(path), _int8_model(src)
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name
    head = gguf_file.lm_head_q8_0(model, path)
    assert head is not None
    ref_head = quant.quantize_per_group(ref.lm_head.detach())
    assert torch.equal(head.qweight, ref_head[0]) and torch.equal(head.scale, ref_head[1])
    prompts = [[(i * 37 + 5) % VOCAB for i in range(20)], [3, 4, 5, 6, 7]]
    # --quantization none: the Q8_0 file runs int8 all the same
    got, want = _generate(path, "none", prompts, tp), _generate(src, "int8", prompts, tp)
    assert got[0] == want[0] and all(len(t) == 12 for t in got[0])
    assert got[1] == want[1] and all(len(lp) == 12 for lp in got[1])  # the sampled tokens' logprobs, bit for bit


@needs_kernels
def test_tp_shards_of_a_q8_0_file_concatenate_to_the_whole(tied_gguf):
    _, path = tied_gguf
    whole = _int8_model(path)
    ranks = [_int8_model(path, 2, r) for r in range(2)]
    for i, layer in enumerate(whole.layers):
        parts = [r.layers[i] for r in ranks]
        a, m = layer.self_attn, layer.mlp
        # row parallel: columns (whole blocks) with their scales
        for mod, name in [("self_attn", "o_weight"), ("mlp", "down_weight")]:
            for suffix in ("", "_scale"):
                got = torch.cat([getattr(getattr(p, mod), name + suffix) for p in parts], dim=1)
                assert torch.equal(got, getattr(getattr(layer, mod), name + suffix)), (i, name + suffix)
        # column parallel: each of q, k, v, gate and up split by rows, with their scales
        spans = {
            "qkv_weight": [(0, a.q_size), (a.q_size, a.kv_size), (a.q_size + a.kv_size, a.kv_size)],
            "gate_up_weight": [(0, m.inter), (m.inter, m.inter)],
        }
        for name, cuts in spans.items():
            mod = "self_attn" if name == "qkv_weight" else "mlp"
            for k, (first, n) in enumerate(cuts):
                for suffix in ("", "_scale"):
                    full = getattr(getattr(layer, mod), name + suffix)
                    shards = []
                    for p in parts:
                        pm = getattr(p, mod)
                        sizes = [pm.q_size, pm.kv_size, pm.kv_size] if mod == "self_attn" else [pm.inter] * 2
                        start = sum(sizes[:k])
                        shards.append(getattr(pm, name + suffix)[start : start + sizes[k]])
                    assert torch.equal(torch.cat(shards), full[first : first + n]), (i, name + suffix, k)
    heads = [gguf_file.lm_head_q8_0(r, path) for r in ranks]
    head = gguf_file.lm_head_q8_0(whole, path)
    assert head is not None and all(h is not None for h in heads)
    assert torch.equal(torch.cat([h.qweight for h in heads if h is not None]), head.qweight)
    assert torch.equal(torch.cat([h.scale for h in heads if h is not None]), head.scale)


def test_an_unsupported_tensor_type_is_refused_with_what_pdserve_reads(tiny_factory, tmp_path):
    src = tiny_factory("llama", **SHAPE)
    path = write_gguf(src, tmp_path / "mixed.gguf", types={"blk.1.ffn_up.weight": Q4_1})
    what = r"tensor 'blk.1.ffn_up.weight' is GGUF type Q4_1; pdserve reads GGUF tensors of types Q8_0, F32, F16, BF16"
    with pytest.raises(ModelConfigError, match=what):
        ModelConfig.from_path(path)
    model = build_model(ModelConfig.from_path(src), ParallelState(), select_backend("cpu"), max_positions=64)
    with pytest.raises(ModelConfigError, match=what):
        load_weights(model, path)


def test_llama31_rope_factors_are_refused_rather_than_dropped(tiny_factory, tmp_path):
    factors = np.ones(SHAPE["head_dim"] // 2, dtype=np.float32)
    path = write_gguf(tiny_factory("llama", **SHAPE), tmp_path / "rope.gguf", extra={"rope_freqs.weight": factors})
    with pytest.raises(ModelConfigError, match="holds rope_freqs"):
        ModelConfig.from_path(path)


def test_a_q8_0_file_refuses_exact_prefill_which_needs_full_precision_weights(tied_gguf):
    _, path = tied_gguf
    with pytest.raises(ModelConfigError, match="holds Q8_0 weights, which run int8; exact_prefill needs"):
        LLMEngine(EngineConfig(model=str(path), exact_prefill=True, num_kv_blocks=64))


def test_a_missing_gguf_file_says_so(tmp_path):
    with pytest.raises(ModelConfigError, match=r"nope\.gguf: cannot read the GGUF file"):
        ModelConfig.from_path(tmp_path / "nope.gguf")


def test_pods_router_and_cluster_take_a_gguf_file_as_the_model(tied_gguf, tmp_path):
    from decode_svc.config import DecodeConfig, DecodeConfigError
    from pdserve.cluster.topology import Topology, TopologyError
    from pdserve.parallel_config import ModelParallelInfo
    from prefill_svc.config import PrefillConfig
    from router.config import RouterConfig

    _, path = tied_gguf
    info = ModelParallelInfo.from_model_path(path)
    assert (info.num_attention_heads, info.num_kv_heads) == (8, 2)
    DecodeConfig(engine=EngineConfig(model=str(path)))
    PrefillConfig(engine=EngineConfig(model=str(path)))
    RouterConfig(model=str(path))
    assert Topology(model=str(path)).resolve(cores=2).decode
    gone = str(tmp_path / "gone.gguf")
    with pytest.raises(DecodeConfigError, match="nor a GGUF file"):
        DecodeConfig(engine=EngineConfig(model=gone))
    with pytest.raises(TopologyError, match="no such GGUF file"):
        Topology(model=gone).resolve(cores=2)
