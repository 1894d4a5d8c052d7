"""What tests and benchmarks build on: tiny random-initialised HF checkpoints for fast tests of odd shapes (written
with transformers itself), compressed-tensors W8A8 copies of checkpoints, a recording KV connector, and an engine
that publishes prompt KV as a prefill pod does."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.kv_connector import KVConnectorMetadata, KVConnectorWorker

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

# MLA + MoE shapes small enough for a test: 8 routed experts in 4 groups (2 per group, as V3's top-2 group score
# needs), 2 chosen per token from the best 2 groups, one shared expert and a dense first layer.
DEEPSEEK_DEFAULTS: dict[str, Any] = dict(
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=1.5,
)


def write_tiny_checkpoint(
    path: str | Path,
    family: str = "llama",
    *,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 256,
    seed: int = 0,
    tokenizer_from: str | Path | None = None,
    **extra: Any,
) -> Path:
    """A random model of the given family; the tokenizer is copied from tokenizer_from (e.g. the default model),
    clipped ids are fine because tests feed token ids directly."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arch = FAMILIES[family]
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    if family.startswith("deepseek"):
        extra = {
            **DEEPSEEK_DEFAULTS,
            **({"topk_method": "group_limited_greedy"} if family == "deepseek_v2" else {}),
            **extra,
        }
        num_kv_heads = num_heads  # MLA has no KV heads; transformers wants them equal to the query heads
    if not family.startswith("deepseek"):  # MLA's head dims are its own (qk_nope/qk_rope/v_head_dim)
        extra["head_dim"] = head_dim
    cfg = cfg_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).to(torch.float32)
    with torch.no_grad():  # HF's init is small; widen it so logits are not all ties
        for p in model.parameters():
            if p.dim() >= 1:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.05)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0).add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # V3's routing bias: zero in a fresh model, not in a real one
                b.normal_(0, 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            src = Path(tokenizer_from) / f
            if src.is_file():
                shutil.copy(src, path / f)
    return path


# The decoder linears a compressed-tensors W8A8 checkpoint of a Llama-family model quantises (llm-compressor's
# recipe targets Linear and ignores lm_head).
_W8A8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_w8a8_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """A compressed-tensors W8A8 copy of the Llama-family checkpoint src, as llm-compressor writes one (format
    int-quantized): each decoder linear's weight int8 with weight_scale [N, 1] per channel, dynamic per-token
    activations; the rest as it is."""
    import json

    from safetensors.torch import load_file, save_file

    from pdserve.model.quant import quantize_per_channel

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    for f in sorted(src.glob("*.safetensors")):
        out: dict[str, torch.Tensor] = {}
        for key, t in load_file(str(f)).items():
            if key.startswith("model.layers.") and key.endswith(".weight") and key.split(".")[-2] in _W8A8_LINEARS:
                q, s = quantize_per_channel(t)
                out[key], out[key + "_scale"] = q, s.unsqueeze(-1)
            else:
                out[key] = t
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
        "ignore": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


class RecordingKVConnector(KVConnectorWorker):
    """A KV-connector worker that records every hook call (tests: what each rank saw, in order)."""

    def __init__(self, runner: Any, tag: str = "") -> None:
        super().__init__(runner)
        self.tag = tag
        self.calls: list[tuple] = []

    def _saves(self, meta: KVConnectorMetadata) -> tuple:
        return tuple((s.request_id, s.block_ids, s.num_tokens) for s in meta.saves)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        self.calls.append(("start_load_kv", self._saves(meta)))

    def save_kv_layer(self, layer: int, meta: KVConnectorMetadata) -> None:
        self.calls.append(("save_kv_layer", layer, self._saves(meta)))

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        self.calls.append(("wait_for_save", self._saves(meta)))

    def info(self) -> tuple[str, int]:
        return self.tag, self.runner.ps.tp_rank

    def take_finished(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls

    def close(self) -> None:
        self.calls.append(("close",))


class EnginePrefill:
    """A TP 1 LLMEngine that prefills prompts and publishes their KV over kv_transfer's TCP path, as a prefill pod
    does: for benchmarks and tests that drive a decode pod without a prefill process. Each prompt is prefilled once
    and its blocks are held until close(); every ``handoff`` is a fresh lease over them, so one prompt can be decoded
    any number of times."""

    def __init__(
        self, model: str | Path, *, num_kv_blocks: int = 512, block_size: int = 16, lease_timeout_s: float = 120.0
    ) -> None:
        from kv_transfer.factory import make_publisher
        from pdserve.engine.llm_engine import EngineConfig, LLMEngine
        from pdserve.pod.convert import kv_layout_for_model

        self.engine = LLMEngine(
            EngineConfig(
                model=str(model), num_kv_blocks=num_kv_blocks, block_size=block_size, enable_prefix_caching=False
            )
        )
        mc, cache = self.engine.model_config, self.engine.executor.kv_cache
        layout = kv_layout_for_model(mc, str(cache.dtype), block_size, num_blocks=num_kv_blocks)
        self.publisher = make_publisher(layout, {0: cache}, backend="tcp", lease_timeout_s=lease_timeout_s)
        self._done: dict[tuple[int, ...], tuple[str, int, float]] = {}  # prompt -> (request id, first, logprob)

    def prefill(self, prompt: list[int]) -> tuple[int, float]:
        """Greedy first token and its logprob; the prompt's KV stays in this engine's blocks."""
        from pdserve.sampling_params import SamplingParams

        key = tuple(prompt)
        if key not in self._done:
            rid = f"prefill-{len(self._done)}"
            self.engine.add_request(
                list(prompt), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), rid, hold_kv=True
            )
            first = None
            while first is None:
                for out in self.engine.step():
                    if out.request_id == rid:
                        first = (out.new_token_ids[0], out.new_logprobs[0])
            self._done[key] = (rid, *first)
        return self._done[key][1:]

    def handoff(self, prompt: list[int], num_tokens: int | None = None) -> Any:
        """A kv_transfer KVHandoff for the prompt's first num_tokens tokens (default: all), on a new lease."""
        self.prefill(prompt)
        rid = self._done[tuple(prompt)][0]
        n = num_tokens or len(prompt)
        table = self.engine.held[rid].block_tables[0][: -(-n // self.engine.config.block_size)]
        lease = self.publisher.publish(rid, {0: list(table)}, n, layers_ready=self.engine.model_config.num_layers)
        return self.publisher.handoff(lease)

    def close(self) -> None:
        self.publisher.close()
        self.engine.shutdown()
