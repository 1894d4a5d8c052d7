"""Rotary position embeddings with the scaling variants HF configs name (default, linear, llama3, yarn)."""

from __future__ import annotations

import math

import torch

from pdserve.model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2], attention scaling applied to cos/sin), as transformers computes them."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if not s:
        return inv_freq, 1.0
    kind = s["rope_type"]
    if kind == "linear":
        return inv_freq / float(s["factor"]), 1.0
    if kind == "llama3":
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(cfg, s, dim, base)
    raise ValueError(f"unsupported rope_type {kind!r}")


def _yarn(cfg: ModelConfig, s: dict, dim: int, base: float) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    old_ctx = int(s.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)

    def correction_dim(rot: float) -> float:
        return (dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attn_factor)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin table indexed by absolute position (HF's rotate_half convention)."""

    cos: torch.Tensor  # buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Looked up once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (query and key heads side by side in one call: half the small ops of two calls, same numbers)."""
    cos, sin = cos_sin
    return x * cos + _rotate_half(x) * sin


def apply_rope_interleaved(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: rotary dims in (x0, x1) pairs, each pair turned by one frequency. The result is
    de-interleaved (evens then odds), as transformers returns it; queries and keys get the same order, so their dot
    products are the interleaved ones."""
    cos, sin = cos_sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
