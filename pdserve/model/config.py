"""Model configuration read from an HF checkpoint's config.json (Llama, Mistral and Qwen2 families)."""
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
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelConfigError(ValueError):
    """A checkpoint this engine cannot run; the message says what is wrong and where."""


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
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise ModelConfigError(f"{cfg_file}: not found; a model directory needs config.json and *.safetensors")
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
            raw=raw,
        )

    def torch_dtype(self) -> torch.dtype:
        return _DTYPES.get(str(self.raw.get("torch_dtype") or self.raw.get("dtype") or "float32"), torch.float32)


def _req(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw:
        raise ModelConfigError(f"{source}: missing required field {key!r}")
    return raw[key]


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
        raise ModelConfigError(f"{source}: rope scaling type {rope_type!r} is not supported; supported: "
                               f"{SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling
