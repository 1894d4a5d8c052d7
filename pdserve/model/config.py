"""Model configuration read from an HF checkpoint's config.json (Llama, Mistral, Qwen2 and DeepSeek-V2/V3
families; Kimi K2 checkpoints name DeepseekV3ForCausalLM), or from a GGUF file's metadata (gguf_file.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelConfigError(ValueError):
    """A checkpoint this engine cannot run; the message says what is wrong and where."""


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): one compressed KV latent per token shared by every head."""

    q_lora_rank: int | None  # None: q comes from one q_proj instead of q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotary dims in (x0, x1) pairs, as DeepSeek's checkpoints are laid out

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the cache: the normalised latent, then the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek's mixture of experts: routed experts (top-k of n, group-limited) plus always-on shared experts."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3, with e_score_correction_bias)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias only
    mlp_bias: bool = False
    sliding_window: int | None = None
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def is_deepseek(self) -> bool:
        return self.family.startswith("deepseek")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        if Path(path).suffix == ".gguf":  # llama.cpp's file: config.json's fields from its metadata
            from pdserve.model import gguf_file  # imports torch-side modules that import this one

            return cls.from_dict(gguf_file.read_config(path), source=str(path))
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise ModelConfigError(
                f"{cfg_file}: not found; a model directory needs config.json and *.safetensors (or give a GGUF file)"
            )
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_file}: invalid JSON ({e})") from e
        return cls.from_dict(raw, source=str(cfg_file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        num_heads = _req(raw, "num_attention_heads", source)
        hidden = _req(raw, "hidden_size", source)
        head_dim = raw.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _rope(raw, source)
        sliding = raw.get("sliding_window")
        if family == "qwen2" and not raw.get("use_sliding_window", False):
            sliding = None  # Qwen2 carries a window size but only uses it when use_sliding_window is true
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(raw.get("attention_bias", False))
        mla = moe = None
        if family.startswith("deepseek"):
            mla, moe = _deepseek(raw, family, source)
            head_dim = mla.qk_rope_head_dim  # what the rotary table is built for, as transformers sets it
        return cls(
            architecture=arch,
            vocab_size=_req(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_req(raw, "intermediate_size", source),
            num_layers=_req(raw, "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=attention_bias if family != "qwen2" else False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            rope_scaling=rope_scaling,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=act,
            mla=mla,
            moe=moe,
            raw=raw,
        )

    def torch_dtype(self) -> torch.dtype:
        return _DTYPES.get(str(self.raw.get("torch_dtype") or self.raw.get("dtype") or "float32"), torch.float32)


def _req(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw:
        raise ModelConfigError(f"{source}: missing required field {key!r}")
    return raw[key]


def _deepseek(raw: dict[str, Any], family: str, source: str) -> tuple[MLAConfig, MoEConfig | None]:
    mla = MLAConfig(
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=int(_req(raw, "kv_lora_rank", source)),
        qk_nope_head_dim=int(_req(raw, "qk_nope_head_dim", source)),
        qk_rope_head_dim=int(_req(raw, "qk_rope_head_dim", source)),
        v_head_dim=int(_req(raw, "v_head_dim", source)),
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )
    if not raw.get("n_routed_experts"):
        return mla, None
    v3 = family == "deepseek_v3"
    # transformers' V3 always scores with sigmoid + correction bias (noaux_tc); V2 names its method.
    method = str(raw.get("topk_method") or ("noaux_tc" if v3 else "greedy"))
    scoring = str(raw.get("scoring_func") or ("sigmoid" if v3 else "softmax"))
    if (method, scoring) not in (("greedy", "softmax"), ("group_limited_greedy", "softmax"), ("noaux_tc", "sigmoid")):
        raise ModelConfigError(
            f"{source}: MoE routing topk_method={method!r} with scoring_func={scoring!r} is not "
            "supported (greedy/group_limited_greedy with softmax, noaux_tc with sigmoid)"
        )
    n = int(raw["n_routed_experts"])
    n_group = int(raw.get("n_group") or 1)
    if n % n_group:
        raise ModelConfigError(f"{source}: n_routed_experts ({n}) must be divisible by n_group ({n_group})")
    moe = MoEConfig(
        n_routed_experts=n,
        num_experts_per_tok=int(_req(raw, "num_experts_per_tok", source)),
        moe_intermediate_size=int(_req(raw, "moe_intermediate_size", source)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
        n_group=n_group,
        topk_group=int(raw.get("topk_group") or n_group),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        scoring_func=scoring,
        topk_method=method,
    )
    return mla, moe


def _rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """Both config styles: transformers<5 (rope_theta + rope_scaling) and >=5 (rope_parameters)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: rope scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling
