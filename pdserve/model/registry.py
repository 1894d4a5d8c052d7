"""Which decoder class runs a checkpoint, chosen by its architecture (ModelConfig.family)."""

from __future__ import annotations

from pdserve.attention import AttentionBackend, select_mla_backend
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek import DeepseekCausalLM
from pdserve.model.llama import CausalLM
from pdserve.model.parallel_state import ParallelState


def build_model(
    cfg: ModelConfig, ps: ParallelState, backend: AttentionBackend, max_positions: int
) -> CausalLM | DeepseekCausalLM:
    if cfg.mla is not None:
        return DeepseekCausalLM(cfg, ps, select_mla_backend(backend), max_positions)
    return CausalLM(cfg, ps, backend, max_positions)
