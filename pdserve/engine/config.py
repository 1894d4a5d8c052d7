"""EngineConfig: what an LLMEngine is built with. Light on purpose (no torch), so that the supervisor and every CLI
can read its fields before anything heavy is imported; ``metadata`` holds each field's command-line help."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.parallel_config import ParallelConfig

CPU_COLLECTIVES = ("auto", "shm", "gloo")
CPU_PINNING = ("auto", "on", "off")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's --kv-cache-dtype values; "fp8" is fp8_e4m3, as in vLLM (pdserve/engine/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's --quantization values that pdserve implements: int8 is W8A8 (pdserve/model/quant.py)
QUANTIZATIONS = ("none", "int8")
ATTENTION_BACKENDS = ("torch", "flashinfer")
MAX_N = 128  # sequences per request (parallel sampling / best_of); more is a mistake, not a workload


@dataclass
class EngineConfig:
    model: str | None = field(
        default=None,
        metadata={
            "help": "HF checkpoint directory, or a llama.cpp GGUF file (Q8_0 / F32 / F16 / BF16 tensors; Q8_0 runs "
            "int8) (default: the bundled SmolLM2 model)",
            "metavar": "PATH",
        },
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest sequence (default: min(max_position_embeddings, 8192))"}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_kv_blocks: int = field(default=2048, metadata={"help": "KV blocks per rank"})
    max_num_seqs: int = field(default=64, metadata={"help": "sequences scheduled at once"})
    max_num_batched_tokens: int = field(default=4096, metadata={"help": "tokens in one engine step"})
    prefill_chunk_size: int = field(default=1024, metadata={"help": "prompt tokens computed per step and sequence"})
    enable_prefix_caching: bool = field(
        default=True, metadata={"aliases": ("--prefix-caching",), "help": "reuse the KV of shared prompt prefixes"}
    )
    tensor_parallel_size: int = field(default=1, metadata={"aliases": ("-tp",), "help": "TP ranks of this pod"})
    decode_context_parallel_size: int = field(
        default=1, metadata={"aliases": ("-dcp",), "help": "decode context parallel size (decode pods)"}
    )
    dcp_kv_cache_interleave_size: int = field(
        default=1, metadata={"help": "tokens per DCP rank before the KV cache moves to the next one"}
    )
    device: str = field(default="cpu", metadata={"help": "torch device: cpu or cuda"})
    attention_backend: str | None = field(
        default=None, metadata={"choices": ATTENTION_BACKENDS, "help": "attention kernels (default: picked by device)"}
    )
    # CPU: prompts computed on F.linear like transformers (logits bit-identical to it) instead of oneDNN-packed
    # weights (faster, logits off by fp32 rounding; figures in docs/performance.md, "Linear layers").
    exact_prefill: bool = field(
        default=False,
        metadata={
            "help": "CPU: compute prompts with transformers' GEMM (bit-identical logits) instead of oneDNN-packed "
            "weights (faster, logits within ~1e-4)"
        },
    )
    # CPU ranks of one pod: "auto" = shared memory (gloo where the host cannot), or "shm" / "gloo" (executor.py).
    cpu_collectives: str = field(
        default="auto",
        metadata={
            "choices": CPU_COLLECTIVES,
            "help": "how CPU ranks of a pod talk: shm (shared memory, the auto choice on Linux) or gloo",
        },
    )
    # "auto" pins rank r to one core when a pod's ranks outnumber its cores, and a single rank's compute threads one
    # per core when there are at least as many cores; "on" / "off".
    cpu_pinning: str = field(
        default="auto",
        metadata={
            "choices": CPU_PINNING,
            "help": "pin each rank to one core, or a single rank's compute threads one per core (auto: when the "
            "pod's ranks outnumber its cores, or a single rank's threads do not)",
        },
    )
    # Norms, softmax, LSE and sampling stay in float32 whatever this is.
    dtype: str = field(
        default="auto",
        metadata={
            "choices": DTYPES,
            "help": "weights, activations and KV cache (auto: the checkpoint's torch_dtype in "
            "config.json, float32 when it names none)",
        },
    )

    # "auto" keeps the KV cache in `dtype`; fp8 stores it in 8 bits with per (layer, block, KV head) scales.
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "choices": KV_CACHE_DTYPES,
            "help": "KV cache storage: auto (the model dtype) or fp8 (= fp8_e4m3) / fp8_e5m2, scaled per layer, "
            "block and KV head from the data; a prefill and a decode pod must agree",
        },
    )

    # "int8": the decoder layers' linear weights quantised at load (per output channel) and their activations per
    # token, int32 sums (pdserve/model/quant.py); embeddings and the LM head stay in `dtype`.
    quantization: str = field(
        default="none",
        metadata={
            "choices": QUANTIZATIONS,
            "help": "CPU: int8 quantises the decoder layers' linear weights at load (per output channel, W8A8 with "
            "activations per token); none keeps them in the model dtype",
        },
    )

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {v!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"EngineConfig.max_model_len must be positive, got {self.max_model_len!r}")
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                "prefill_chunk_size must not exceed max_num_batched_tokens "
                f"({self.prefill_chunk_size} > {self.max_num_batched_tokens})"
            )
        if self.cpu_collectives not in CPU_COLLECTIVES:
            raise ValueError(
                f"EngineConfig.cpu_collectives must be one of {', '.join(CPU_COLLECTIVES)}, "
                f"got {self.cpu_collectives!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"EngineConfig.quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r} "
                "(int8: W8A8 from the full-precision checkpoint)"
            )
        if self.quantization != "none" and self.exact_prefill:
            raise ValueError(
                "exact_prefill computes prompts on the full-precision weights, which quantization "
                f"{self.quantization} does not keep: drop one of the two"
            )
        if self.cpu_pinning not in CPU_PINNING:
            raise ValueError(
                f"EngineConfig.cpu_pinning must be one of {', '.join(CPU_PINNING)}, got {self.cpu_pinning!r}"
            )

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            decode_context_parallel_size=self.decode_context_parallel_size,
            dcp_kv_cache_interleave_size=self.dcp_kv_cache_interleave_size,
            block_size=self.block_size,
        )
