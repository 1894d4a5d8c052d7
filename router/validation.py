"""Config validation for the router: the ValidateConfig RPC and the check every registering pod goes through.

Both call pdserve.parallel_config (the ONE module with vLLM's rules); this module only adds the proto plumbing and
the two pdserve rules that are about a pod's *role*: DCP is for decode pods only, and a pod runs one data-parallel
replica (scale out with more pods).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import grpc

from pdserve.errors import ServiceError
from pdserve.parallel_config import (
    Fix,
    ModelParallelInfo,
    ParallelConfig,
    check_parallel_config,
    num_local_kv_heads,
)
from pdserve_api.v1 import common_pb2, router_pb2

DEFAULT_BLOCK_SIZE = 16

_ELEMENT_SIZE = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class ModelFacts:
    """The model numbers validation and the KV layout need."""

    info: ModelParallelInfo
    num_layers: int = 0
    head_dim: int = 0
    dtype: str = ""
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0


@dataclass
class RoleVerdict:
    valid: bool
    message: str
    fixes: list[tuple[str, str, str]] = field(default_factory=list)  # (flag, suggested value, text)
    warnings: list[str] = field(default_factory=list)
    parallel: ParallelConfig | None = None

    def refusal_text(self) -> str:
        """One line for logs and RegisterWorker: the rule's message plus the fix."""
        if self.valid:
            return self.message
        if not self.fixes:
            return self.message
        text = self.fixes[0][2]
        args = " ".join(f"{f} {v}" for f, v, _ in self.fixes)
        return f"{self.message} Fix: {text} ({args})"


# ----------------------------------------------------------------------------------------------------------------
# Model facts from a path or a ModelShape
# ----------------------------------------------------------------------------------------------------------------


def facts_from_path(path: str) -> ModelFacts:
    p = os.fspath(path)
    cfg_path = os.path.join(p, "config.json") if os.path.isdir(p) else p
    if not os.path.isfile(cfg_path):
        raise ServiceError(
            grpc.StatusCode.NOT_FOUND,
            f"model_path {path!r}: no config.json at {cfg_path}; give a model directory "
            "the router can read, or send the model's shape instead",
        )
    try:
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8
        raise ServiceError(grpc.StatusCode.NOT_FOUND, f"model_path {path!r}: cannot read {cfg_path}: {e}") from e
    if not isinstance(raw, dict):
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"model_path {path!r}: {cfg_path} must hold a JSON object (a HF config), got {type(raw).__name__}",
        )
    try:
        return _facts_from_config(raw)
    except (ValueError, TypeError, AttributeError, ArithmeticError) as e:  # fields of the wrong type / value
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"model_path {path!r}: {cfg_path}: {e}") from e


def _facts_from_config(raw: dict) -> ModelFacts:
    info = ModelParallelInfo.from_hf_config(raw)
    if not isinstance(raw.get("text_config"), dict) or raw.get("num_attention_heads") is not None:
        txt = raw
    else:
        txt = raw["text_config"]
    heads = info.num_attention_heads
    head_dim = txt.get("head_dim") or ((txt.get("hidden_size") or 0) // heads if heads else 0)
    facts = ModelFacts(
        info=info,
        num_layers=int(txt.get("num_hidden_layers") or 0),
        head_dim=int(head_dim or 0),
        dtype=str(txt.get("torch_dtype") or txt.get("dtype") or raw.get("torch_dtype") or "float32"),
        kv_lora_rank=int(txt.get("kv_lora_rank") or 0),
        qk_rope_head_dim=int(txt.get("qk_rope_head_dim") or 0),
    )
    # Every count ends up in int32 proto fields (KVLayout): out of that range it is not a real model.
    for name, v in (
        ("num_attention_heads", info.num_attention_heads),
        ("num_key_value_heads", info.num_kv_heads),
        ("num_hidden_layers", facts.num_layers),
        ("head_dim", facts.head_dim),
        ("kv_lora_rank", facts.kv_lora_rank),
        ("qk_rope_head_dim", facts.qk_rope_head_dim),
    ):
        if not 0 <= v < 2**31:
            raise ValueError(f"{name} {v} is out of range [0, 2**31)")
    return facts


def facts_from_shape(shape: common_pb2.ModelShape, what: str = "shape") -> ModelFacts:
    if shape.num_attention_heads <= 0:
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what}.num_attention_heads must be a positive integer, got {shape.num_attention_heads}",
        )
    if shape.num_kv_heads < 0:
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what}.num_kv_heads must be >= 1 (or 0 for MHA: same as num_attention_heads), got {shape.num_kv_heads}",
        )
    for name in (
        "num_layers",
        "head_dim",
        "hidden_size",
        "vocab_size",
        "max_model_len",
        "sliding_window",
        "kv_lora_rank",
        "qk_rope_head_dim",
    ):
        if getattr(shape, name) < 0:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{what}.{name} must be >= 0, got {getattr(shape, name)}"
            )
    if shape.use_mla and shape.kv_lora_rank + shape.qk_rope_head_dim >= 2**31:
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what}: kv_lora_rank + qk_rope_head_dim (the MLA cache head size) must be below "
            f"2**31, got {shape.kv_lora_rank + shape.qk_rope_head_dim}",
        )
    kv = shape.num_kv_heads or shape.num_attention_heads
    try:
        info = ModelParallelInfo(
            num_attention_heads=shape.num_attention_heads,
            num_kv_heads=kv,
            use_mla=shape.use_mla,
            sliding_window=shape.sliding_window or None,
        )
    except ValueError as e:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {e}") from e
    head_dim = shape.head_dim or (shape.hidden_size // shape.num_attention_heads if shape.hidden_size else 0)
    return ModelFacts(
        info=info,
        num_layers=shape.num_layers,
        head_dim=head_dim,
        dtype=shape.dtype,
        kv_lora_rank=shape.kv_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim,
    )


# ----------------------------------------------------------------------------------------------------------------
# The verdict for a role
# ----------------------------------------------------------------------------------------------------------------


def _or_default(v: int, default: int = 1) -> int:
    return default if v == 0 else v  # proto3 convention: 0 = unset


def parallel_from_proto(p: common_pb2.ParallelConfig, block_size: int) -> ParallelConfig:
    return ParallelConfig(
        tensor_parallel_size=_or_default(p.tensor_parallel_size),
        decode_context_parallel_size=_or_default(p.decode_context_parallel_size),
        pipeline_parallel_size=_or_default(p.pipeline_parallel_size),
        dcp_kv_cache_interleave_size=_or_default(p.dcp_kv_cache_interleave_size),
        block_size=_or_default(block_size, DEFAULT_BLOCK_SIZE),
    )


def _fix_rows(fix: Fix) -> list[tuple[str, str, str]]:
    rows = []
    for i, (flag, value) in enumerate(fix.changes.items()):
        rows.append((flag, str(value), fix.text if i == 0 else f"Use `{flag} {value}` (part of the fix above)."))
    return rows


def check_for_role(
    model: ModelParallelInfo, cfg: ParallelConfig, role: int, data_parallel_size: int = 1
) -> RoleVerdict:
    """vLLM's rules via pdserve.parallel_config, plus the role rules. ``role``: common_pb2.Role value; unspecified
    means decode (the strictest: it is the only role where DCP applies)."""
    is_prefill = role == common_pb2.ROLE_PREFILL
    role_name = "prefill" if is_prefill else "decode"
    # Role rules come first: they are about what the pod *is*, so no parallel tweak can satisfy them otherwise.
    role_msg: str | None = None
    role_fixes: list[tuple[str, str, str]] = []
    effective = cfg
    if is_prefill and cfg.decode_context_parallel_size != 1:
        role_msg = (
            f"decode context parallelism is for decode pods only, but this prefill pod has "
            f"`--decode-context-parallel-size` ({cfg.decode_context_parallel_size})."
        )
        role_fixes.append(
            (
                "--decode-context-parallel-size",
                "1",
                "Set `--decode-context-parallel-size 1` on prefill pods (DCP shards the KV of decode "
                "pods; prefill pods hand their KV over whole).",
            )
        )
        effective = ParallelConfig(cfg.tensor_parallel_size, 1, cfg.pipeline_parallel_size, 1, cfg.block_size)
    if data_parallel_size not in (0, 1):
        msg = (
            f"`--data-parallel-size` ({data_parallel_size}) is not supported inside a pdserve pod: each pod is "
            "one replica; run more pods instead."
        )
        role_msg = role_msg or msg
        role_fixes.append(
            ("--data-parallel-size", "1", "Use `--data-parallel-size 1` and scale out by starting more pods.")
        )
    verdict = check_parallel_config(model, effective)
    if role_msg is not None:
        fixes = role_fixes + ([] if verdict.valid else _fix_rows(verdict.fix))  # type: ignore[arg-type]
        return RoleVerdict(False, role_msg, fixes, parallel=cfg)
    if not verdict.valid:
        return RoleVerdict(False, verdict.message, _fix_rows(verdict.fix), parallel=cfg)  # type: ignore[arg-type]
    warnings = []
    tp, kv = cfg.tensor_parallel_size, model.num_kv_heads
    if not model.use_mla and tp > kv:
        warnings.append(
            f"KV heads are replicated: {kv} KV heads over {tp} TP ranks, so each KV head is stored on "
            f"{tp // kv} ranks"
            + (" (DCP splits its tokens across them)." if cfg.decode_context_parallel_size > 1 else ".")
        )
    if cfg.pipeline_parallel_size > 1:
        warnings.append(
            f"pipeline_parallel_size {cfg.pipeline_parallel_size} passes vLLM's rules, but pdserve "
            "workers run pipeline_parallel_size 1 only."
        )
    return RoleVerdict(True, verdict.message + f" ({role_name} pod)", [], warnings, parallel=cfg)


def kv_layout_for(facts: ModelFacts, cfg: ParallelConfig, role: int) -> common_pb2.KVLayout:
    """The per-rank KV layout a valid config produces (num_blocks 0: unknown without a device)."""
    m = facts.info
    mla = m.use_mla
    kv_heads = 1 if mla else m.num_kv_heads
    head_dim = (facts.kv_lora_rank + facts.qk_rope_head_dim) if mla else facts.head_dim
    dcp = 1 if role == common_pb2.ROLE_PREFILL else cfg.decode_context_parallel_size
    return common_pb2.KVLayout(
        num_layers=facts.num_layers,
        block_size=cfg.block_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=facts.dtype,
        tp_size=cfg.tensor_parallel_size,
        dcp_size=dcp,
        dcp_kv_cache_interleave_size=cfg.dcp_kv_cache_interleave_size if dcp > 1 else 1,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
        num_blocks=0,
        num_kv_heads_per_rank=1 if mla else num_local_kv_heads(kv_heads, cfg.tensor_parallel_size),
        use_mla=mla,
        element_size=_ELEMENT_SIZE.get(facts.dtype.replace("torch.", ""), 0),
    )


def validate_config_rpc(req: router_pb2.ValidateConfigRequest) -> router_pb2.ValidateConfigResponse:
    """Router.ValidateConfig. Raises ServiceError (INVALID_ARGUMENT / NOT_FOUND) for malformed requests only."""
    if req.role not in common_pb2.Role.values():
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"role {req.role} is not a Role: use ROLE_PREFILL, ROLE_DECODE or leave it unset",
        )
    source = req.WhichOneof("model_source")
    if source is None:
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "set exactly one of model_path (a model directory) or shape (the model's head "
            "counts) in ValidateConfigRequest",
        )
    if source == "model_path":
        if not req.model_path:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "model_path is empty")
        facts = facts_from_path(req.model_path)
    else:
        facts = facts_from_shape(req.shape)
    # Negative sizes are not an error: the positive-size rule reports them as a verdict with a fix.
    cfg = parallel_from_proto(req.parallel, req.block_size)
    role = req.role if req.role != common_pb2.ROLE_UNSPECIFIED else common_pb2.ROLE_DECODE
    v = check_for_role(facts.info, cfg, role, req.parallel.data_parallel_size)
    resp = router_pb2.ValidateConfigResponse(valid=v.valid, message=v.message, warnings=v.warnings)
    for flag, value, text in v.fixes:
        resp.fixes.add(flag=flag, suggested_value=value, text=text)
    if v.valid:
        resp.kv_layout.CopyFrom(kv_layout_for(facts, cfg, role))
    return resp


def shape_mismatch(a: common_pb2.ModelShape, b: common_pb2.ModelShape) -> str | None:
    """First field where two pods serving the same model disagree (fields that decide KV compatibility)."""
    for name in (
        "architecture",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
        "use_mla",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "dtype",
    ):
        x, y = getattr(a, name), getattr(b, name)
        if x != y and x and y:  # 0 / "" means "not reported"
            return f"{name} {y!r} (this pod) != {x!r} (pods already serving the model)"
    return None
