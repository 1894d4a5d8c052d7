"""vLLM's parallel-config rules for pdserve: the ONE module router, workers and CLI call.

Everything that decides whether a (model, TP, DCP, PP, interleave, block size) combination can run, and how heads
and tokens are laid out across ranks, lives here so that the services can never disagree about it.

Rules are checked in the order vLLM hits them when it starts an engine, and the first failing rule is reported
(vLLM raises on the first one too). Where vLLM has a message, it is reproduced verbatim:

  * ``tp_size=... must be divisible by dcp_size=...`` -- vllm/config/parallel.py
    ``ParallelConfig._validate_parallel_config`` (read at vllm-project/vllm@00193b82b0e2d4faea5d3b4ea4f6c4c2bd9d057a).
  * ``Total number of attention heads ...`` -- vllm/config/model.py ``ModelConfig.verify_with_parallel_config``
    (the same text in every vLLM version read).
  * The three DCP GQA/MQA messages -- vllm/config/model.py ``verify_with_parallel_config`` at
    vllm-project/vllm@c794754062 (model.py:1390). The third ("The model's number of query heads per KV head ...")
    is quoted from its start; its tail follows a third-party copy of the text, with backticks around the flag as in
    its two sibling messages.
  * ``Block_size(...) should be greater than or equal to and divisible by cp_kv_cache_interleave_size (...)`` --
    vllm/config/vllm.py ``VllmConfig.__post_init__`` (only checked when DCP > 1, as in vLLM).
  * ``DCP not support sliding window.`` -- vllm/v1/kv_cache_interface.py
    ``SlidingWindowSpec.max_memory_usage_bytes`` (an assert at KV-cache sizing time, i.e. after all config checks).

Two rules carry pdserve wording because vLLM enforces them with a pydantic field constraint or a bare assert:
positive sizes (vLLM: ``Field(ge=1)`` on the parallel sizes) and the even KV-head split
(vLLM: ``divide()`` in ``QKVParallelLinear`` at model load, message "{a} is not divisible by {b}").
One rule is pdserve's own (vLLM's config checks do not have it): with DCP on a GQA/MQA model, DCP must divide the
number of TP ranks per KV head, so that each DCP group (consecutive TP ranks) holds one and the same KV head, which
the layout in docs/DESIGN.md relies on.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = [
    "ModelParallelInfo",
    "ParallelConfig",
    "Fix",
    "Verdict",
    "ParallelConfigError",
    "RULES",
    "check_parallel_config",
    "validate_parallel_config",
    "kv_heads_for_tp_rank",
    "q_heads_for_tp_rank",
    "num_local_kv_heads",
    "dcp_rank_of",
    "dcp_group_ranks",
    "dcp_owner",
    "dcp_local_index",
    "dcp_local_count",
    "dcp_local_num_blocks",
]


# --------------------------------------------------------------------------------------------------------------
# Model description
# --------------------------------------------------------------------------------------------------------------


def _is_pos_int(v: Any) -> bool:
    # bool is an int subclass; True must not pass as "1 GPU".
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


# Keys vLLM's ModelArchConfig / get_total_num_kv_heads looks at, in the same spirit (first present non-null wins).
_KV_HEAD_KEYS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")
_Q_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")


@dataclass(frozen=True)
class ModelParallelInfo:
    """The few numbers of a model that the parallel rules depend on."""

    num_attention_heads: int  # total query heads (H)
    num_kv_heads: int  # total KV heads; == H for MHA, 1 for MQA
    use_mla: bool = False  # MLA (DeepSeek-style latent KV): the GQA/MQA DCP rules do not apply
    sliding_window: int | None = None  # any sliding-window attention layer makes DCP unsupported

    def __post_init__(self) -> None:
        # Refuse nonsense early so check_parallel_config only ever reasons about real models.
        if not _is_pos_int(self.num_attention_heads):
            raise ValueError(f"num_attention_heads must be a positive integer, got {self.num_attention_heads!r}.")
        if not _is_pos_int(self.num_kv_heads):
            raise ValueError(f"num_kv_heads must be a positive integer, got {self.num_kv_heads!r}.")
        if not self.use_mla and self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads})."
            )
        if self.sliding_window is not None and not _is_pos_int(self.sliding_window):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}.")

    @property
    def kind(self) -> str:
        if self.use_mla:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelParallelInfo":
        """Build from a Hugging Face ``config.json`` dict.

        - ``num_key_value_heads`` missing/null -> MHA (KV heads == query heads), as HF and vLLM do.
        - ``kv_lora_rank`` present and non-null -> MLA (DeepSeek V2/V3 style).
        - ``sliding_window`` counts only when ``use_sliding_window`` is not False (Qwen2 ships a window value
          but disables it with that flag).
        """
        if not isinstance(cfg, Mapping):
            raise TypeError(f"expected a config dict, got {type(cfg).__name__}")
        # Multimodal wrappers keep the language model's numbers under text_config.
        if not any(cfg.get(k) is not None for k in _Q_HEAD_KEYS) and isinstance(cfg.get("text_config"), Mapping):
            cfg = cfg["text_config"]
        heads = next((cfg[k] for k in _Q_HEAD_KEYS if cfg.get(k) is not None), None)
        if heads is None:
            raise ValueError("model config has no num_attention_heads")
        kv = next((cfg[k] for k in _KV_HEAD_KEYS if cfg.get(k) is not None), None)
        if kv is None:
            # Falcon-style multi_query flag means one shared KV head; otherwise plain MHA.
            kv = 1 if cfg.get("multi_query") is True else heads
        use_mla = cfg.get("kv_lora_rank") is not None
        sw = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            sw = None
        if isinstance(sw, bool) or (sw is not None and not isinstance(sw, int)):
            raise ValueError(f"unsupported sliding_window value {sw!r}")
        if sw is not None and sw <= 0:
            sw = None  # some configs write 0/-1 for "no window"
        return cls(num_attention_heads=heads, num_kv_heads=kv, use_mla=use_mla, sliding_window=sw)

    @classmethod
    def from_model_path(cls, path: str | os.PathLike[str]) -> "ModelParallelInfo":
        """Read ``config.json`` from a model directory (or the path of a config.json itself), or a GGUF file's
        metadata."""
        p = os.fspath(path)
        if p.endswith(".gguf"):
            from pdserve.model import gguf_file  # torch-side: imported only for a GGUF model

            return cls.from_hf_config(gguf_file.read_config(p))
        cfg_path = os.path.join(p, "config.json") if os.path.isdir(p) else p
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json at {cfg_path}")
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        return cls.from_hf_config(cfg)


# --------------------------------------------------------------------------------------------------------------
# Parallel config, verdicts, errors
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelConfig:
    """The user's parallel choices. Not validated on construction so a bad one can still be reported on."""

    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1  # DCP reuses TP ranks (no extra GPUs), decode only
    pipeline_parallel_size: int = 1
    dcp_kv_cache_interleave_size: int = 1  # tokens per DCP rank before moving to the next rank
    block_size: int = 16  # KV-cache block size in tokens

    @property
    def world_size(self) -> int:
        # DCP folds inside TP, so it does not add ranks (same as vLLM).
        return self.tensor_parallel_size * self.pipeline_parallel_size


# CLI flag of each field, used in messages and fixes.
FLAGS: dict[str, str] = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "decode_context_parallel_size": "--decode-context-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "dcp_kv_cache_interleave_size": "--dcp-kv-cache-interleave-size",
    "block_size": "--block-size",
}
_FIELD_OF_FLAG = {v: k for k, v in FLAGS.items()}


@dataclass(frozen=True)
class Fix:
    """A concrete change that makes the whole config valid: ``flag value`` (plus ``also`` when one flag is not
    enough). ``text`` says the same in words."""

    flag: str
    value: int
    text: str
    also: tuple[tuple[str, int], ...] = ()

    @property
    def changes(self) -> dict[str, int]:
        return {self.flag: self.value, **dict(self.also)}

    @property
    def cli_args(self) -> list[str]:
        out: list[str] = []
        for flag, value in self.changes.items():
            out += [flag, str(value)]
        return out

    def apply(self, cfg: ParallelConfig) -> ParallelConfig:
        return dataclasses.replace(cfg, **{_FIELD_OF_FLAG[f]: v for f, v in self.changes.items()})


@dataclass(frozen=True)
class Verdict:
    valid: bool
    message: str  # the refusal (vLLM's text where it has one), or a one-line summary when valid
    fix: Fix | None = None  # None when valid
    rule: str | None = None  # id of the failing rule (see RULES), None when valid


class ParallelConfigError(ValueError):
    """Raised by validate_parallel_config; ``.message`` is the rule's message, ``.fix`` the suggested change."""

    def __init__(self, message: str, fix: Fix | None = None, rule: str | None = None) -> None:
        self.message = message
        self.fix = fix
        self.rule = rule
        super().__init__(message if fix is None else f"{message} Suggested fix: {fix.text}")


# --------------------------------------------------------------------------------------------------------------
# The rules, in vLLM's order
# --------------------------------------------------------------------------------------------------------------

# (rule id, one-line description). Order == checking order.
RULES: tuple[tuple[str, str], ...] = (
    ("positive_sizes", "all sizes are positive integers (pipeline, tensor, DCP, interleave, block size)"),
    ("tp_divisible_by_dcp", "tensor_parallel_size % decode_context_parallel_size == 0"),
    ("heads_divisible_by_tp", "num_attention_heads % tensor_parallel_size == 0"),
    ("dcp_tp_gt_kv_heads", "GQA/MQA with DCP > 1: tensor_parallel_size > total KV heads"),
    ("dcp_max_size", "GQA/MQA with DCP > 1: DCP <= tensor_parallel_size // total KV heads"),
    ("dcp_q_per_kv", "GQA/MQA with DCP > 1: (query heads per KV head) % DCP == 0"),
    ("interleave_block_size", "DCP > 1: interleave <= block_size and block_size % interleave == 0"),
    ("kv_heads_split", "non-MLA: KV heads split evenly across TP ranks (kv % tp == 0 or tp % kv == 0)"),
    ("dcp_group_kv_head", "GQA/MQA with DCP > 1: (TP ranks per KV head) % DCP == 0, so a DCP group shares a KV head"),
    ("dcp_sliding_window", "DCP > 1 is refused for models with sliding-window attention"),
)
_RULE_INDEX = {r: i for i, (r, _) in enumerate(RULES)}

# pdserve's order for the positivity check: vLLM's field declaration order, then the cache fields.
_POSITIVE_FIELDS = (
    "pipeline_parallel_size",
    "tensor_parallel_size",
    "decode_context_parallel_size",
    "dcp_kv_cache_interleave_size",
    "block_size",
)


def _first_failure(model: ModelParallelInfo, cfg: ParallelConfig) -> tuple[str, str, str | None] | None:
    """(rule id, message, offending field) of the first failing rule, or None if the config is valid."""
    for name in _POSITIVE_FIELDS:
        v = getattr(cfg, name)
        if not _is_pos_int(v):
            return "positive_sizes", f"`{FLAGS[name]}` must be a positive integer (>= 1), got {v!r}.", name

    tp = cfg.tensor_parallel_size
    dcp = cfg.decode_context_parallel_size
    heads = model.num_attention_heads
    kv = model.num_kv_heads

    # vllm/config/parallel.py: checked when ParallelConfig is built, before the model is looked at.
    if tp % dcp != 0:
        return "tp_divisible_by_dcp", f"tp_size={tp} must be divisible by dcp_size={dcp}.", None

    # vllm/config/model.py verify_with_parallel_config, in source order.
    if heads % tp != 0:
        return (
            "heads_divisible_by_tp",
            f"Total number of attention heads ({heads}) must be divisible by tensor parallel size ({tp}).",
            None,
        )
    if dcp > 1 and not model.use_mla:
        if tp <= kv:
            return (
                "dcp_tp_gt_kv_heads",
                "Decode context parallelism for GQA/MQA requires "
                f"`--tensor-parallel-size` ({tp}) to be "
                "greater than the model's total number of KV heads "
                f"({kv}). Increase `--tensor-parallel-size` "
                "or set `--decode-context-parallel-size 1`.",
                None,
            )
        max_dcp = tp // kv
        if dcp > max_dcp:
            return (
                "dcp_max_size",
                "`--decode-context-parallel-size` "
                f"({dcp}) exceeds the maximum "
                f"supported value ({max_dcp}) for "
                f"`--tensor-parallel-size` ({tp}) and "
                f"{kv} model KV heads.",
                None,
            )
        num_q_per_kv = heads // kv
        if num_q_per_kv % dcp != 0:
            return (
                "dcp_q_per_kv",
                f"The model's number of query heads per KV head ({num_q_per_kv}) "
                f"must be divisible by `--decode-context-parallel-size` ({dcp}) for GQA/MQA.",
                None,
            )

    # vllm/config/vllm.py VllmConfig.__post_init__ ("If DCP, ensure the block size is right.").
    interleave = cfg.dcp_kv_cache_interleave_size
    block = cfg.block_size
    if dcp > 1 and not (interleave <= block and block % interleave == 0):
        return (
            "interleave_block_size",
            f"Block_size({block}) should be greater "
            "than or equal to and divisible by cp_kv_cache_interleave_size "
            f"({interleave}).",
            None,
        )

    # vLLM QKVParallelLinear (model load): divide(kv, tp) or divide(tp, kv). pdserve wording. MLA keeps one latent
    # KV "head" replicated on every rank, so it has no split to check.
    if not model.use_mla and kv % tp != 0 and tp % kv != 0:
        return (
            "kv_heads_split",
            f"The model's total number of KV heads ({kv}) cannot be split evenly across "
            f"`--tensor-parallel-size` ({tp}) ranks: one of them must divide the other "
            f"(vLLM's QKVParallelLinear refuses this at model load).",
            None,
        )

    # pdserve rule, not checked by vLLM's config code: DCP groups are runs of `dcp` consecutive TP ranks and the DCP
    # attention runs every gathered query head of the group against the rank's local KV head, so all ranks of a
    # group must hold the same KV head. Needs dcp | (tp // kv): e.g. TP 12, 2 KV heads, DCP 4 passes vLLM's three
    # GQA checks but its group of ranks 4..7 would hold KV heads 0, 0, 1, 1.
    if dcp > 1 and not model.use_mla and (tp // kv) % dcp != 0:
        return (
            "dcp_group_kv_head",
            f"`--decode-context-parallel-size` ({dcp}) must divide the number of TP ranks per KV head "
            f"(`--tensor-parallel-size` {tp} // {kv} KV heads = {tp // kv}) so that every decode context "
            "parallel group holds the same KV head.",
            None,
        )

    # vllm/v1/kv_cache_interface.py SlidingWindowSpec.max_memory_usage_bytes (KV-cache sizing, last).
    if dcp > 1 and model.sliding_window is not None:
        return "dcp_sliding_window", "DCP not support sliding window.", None
    return None


def _is_valid(model: ModelParallelInfo, cfg: ParallelConfig) -> bool:
    return _first_failure(model, cfg) is None


# --------------------------------------------------------------------------------------------------------------
# Fix search
# --------------------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_candidates(model: ModelParallelInfo, cfg: ParallelConfig) -> list[ParallelConfig]:
    # A valid TP must divide the head count, so the divisors of H are the whole search space. Smallest TP at or
    # above the requested one first (the user asked for that many GPUs), then the closest ones below it.
    cur = cfg.tensor_parallel_size if _is_pos_int(cfg.tensor_parallel_size) else 1
    divs = _divisors(model.num_attention_heads)
    order = [d for d in divs if d >= cur] + [d for d in reversed(divs) if d < cur]
    return [dataclasses.replace(cfg, tensor_parallel_size=d) for d in order if d != cfg.tensor_parallel_size]


def _dcp_down_candidates(model: ModelParallelInfo, cfg: ParallelConfig) -> list[ParallelConfig]:
    # Largest DCP > 1 below the requested one that divides TP (keeps context parallelism, just less of it).
    tp, dcp = cfg.tensor_parallel_size, cfg.decode_context_parallel_size
    if not (_is_pos_int(tp) and _is_pos_int(dcp)):
        return []
    return [dataclasses.replace(cfg, decode_context_parallel_size=d) for d in reversed(_divisors(tp)) if 1 < d < dcp]


def _dcp_one(model: ModelParallelInfo, cfg: ParallelConfig) -> list[ParallelConfig]:
    return [] if cfg.decode_context_parallel_size == 1 else [dataclasses.replace(cfg, decode_context_parallel_size=1)]


def _pp_one(model: ModelParallelInfo, cfg: ParallelConfig) -> list[ParallelConfig]:
    return [dataclasses.replace(cfg, pipeline_parallel_size=1)]


def _interleave_candidates(model: ModelParallelInfo, cfg: ParallelConfig) -> list[ParallelConfig]:
    # Largest interleave that divides the block size and does not exceed the requested interleave.
    block, cur = cfg.block_size, cfg.dcp_kv_cache_interleave_size
    if not _is_pos_int(block):
        return [dataclasses.replace(cfg, dcp_kv_cache_interleave_size=1)]
    cap = cur if _is_pos_int(cur) else 1
    return [
        dataclasses.replace(cfg, dcp_kv_cache_interleave_size=d)
        for d in reversed(_divisors(block))
        if d <= cap and d != cur
    ]


def _block_candidates(model: ModelParallelInfo, cfg: ParallelConfig) -> list[ParallelConfig]:
    # Smallest block size >= max(requested, 16 if unusable) that the interleave divides.
    inter = cfg.dcp_kv_cache_interleave_size
    inter = inter if _is_pos_int(inter) else 1
    floor = cfg.block_size if _is_pos_int(cfg.block_size) else 16
    return [dataclasses.replace(cfg, block_size=-(-floor // inter) * inter)]


_Strategy = Callable[[ModelParallelInfo, ParallelConfig], list[ParallelConfig]]

# Per rule: the changes to try, most preferred first.
_STRATEGIES: dict[str, tuple[_Strategy, ...]] = {
    "tp_divisible_by_dcp": (_dcp_down_candidates, _tp_candidates, _dcp_one),
    "heads_divisible_by_tp": (_tp_candidates, _dcp_one),
    "dcp_tp_gt_kv_heads": (_tp_candidates, _dcp_one),
    "dcp_max_size": (_dcp_down_candidates, _tp_candidates, _dcp_one),
    "dcp_q_per_kv": (_dcp_down_candidates, _tp_candidates, _dcp_one),
    "interleave_block_size": (_interleave_candidates, _block_candidates, _dcp_one),
    "kv_heads_split": (_tp_candidates, _dcp_one),
    "dcp_group_kv_head": (_dcp_down_candidates, _tp_candidates, _dcp_one),
    "dcp_sliding_window": (_dcp_one,),
}
_POSITIVE_STRATEGY: dict[str, tuple[_Strategy, ...]] = {
    "pipeline_parallel_size": (_pp_one,),
    "tensor_parallel_size": (_tp_candidates,),
    "decode_context_parallel_size": (_dcp_one,),
    "dcp_kv_cache_interleave_size": (_interleave_candidates,),
    "block_size": (_block_candidates,),
}


def _repair_step(model: ModelParallelInfo, cfg: ParallelConfig) -> ParallelConfig | None:
    """One change for the first failing rule: a fully valid config if any candidate gives one, else the first
    candidate that gets past this rule (a later rule fails instead)."""
    failure = _first_failure(model, cfg)
    assert failure is not None
    rule, _, fld = failure
    strategies = _POSITIVE_STRATEGY[fld] if fld is not None else _STRATEGIES[rule]
    cands = [c for s in strategies for c in s(model, cfg)]
    for c in cands:
        if _is_valid(model, c):
            return c
    here = _RULE_INDEX[rule]
    for c in cands:
        f = _first_failure(model, c)
        if f is not None and (_RULE_INDEX[f[0]] > here or (f[0] == rule == "positive_sizes" and f[2] != fld)):
            return c
    return None


def _safe_config(model: ModelParallelInfo, cfg: ParallelConfig) -> ParallelConfig:
    """Always-valid fallback: DCP off, usable sizes, and the TP closest to the requested one that works."""
    base = dataclasses.replace(
        cfg,
        decode_context_parallel_size=1,
        pipeline_parallel_size=cfg.pipeline_parallel_size if _is_pos_int(cfg.pipeline_parallel_size) else 1,
        block_size=cfg.block_size if _is_pos_int(cfg.block_size) else 16,
        dcp_kv_cache_interleave_size=(
            cfg.dcp_kv_cache_interleave_size if _is_pos_int(cfg.dcp_kv_cache_interleave_size) else 1
        ),
    )
    if _is_valid(model, base):
        return base
    for c in _tp_candidates(model, base):
        if _is_valid(model, c):
            return c
    return dataclasses.replace(base, tensor_parallel_size=1)  # TP=1, DCP=1 is valid for every model


def _describe(flag: str, new: int, old: Any, cfg: ParallelConfig, alone: bool) -> str:
    """Words for one change. The "why this value" part is only claimed when the change is the whole fix, because
    only then was it found by the plain search the words describe."""
    if flag == "--decode-context-parallel-size" and new == 1:
        return "set `--decode-context-parallel-size 1` (turn decode context parallelism off)"
    if not alone:
        return f"use `{flag} {new}`"
    if flag == "--tensor-parallel-size":
        if _is_pos_int(old) and new >= old:
            return f"use `--tensor-parallel-size {new}` (the smallest valid value at or above the requested {old})"
        if _is_pos_int(old):
            return (
                f"use `--tensor-parallel-size {new}` (no valid value at or above the requested {old}; "
                "this is the closest one below)"
            )
        return f"use `--tensor-parallel-size {new}` (the smallest valid value)"
    if flag == "--decode-context-parallel-size":
        return (
            f"use `--decode-context-parallel-size {new}` (the largest valid value below the requested {old} "
            f"for `--tensor-parallel-size` {cfg.tensor_parallel_size})"
        )
    if flag == "--dcp-kv-cache-interleave-size":
        return (
            f"use `--dcp-kv-cache-interleave-size {new}` (the largest value not above the requested {old!r} "
            f"that divides `--block-size` {cfg.block_size})"
        )
    return f"use `{flag} {new}`"


def _suggest_fix(model: ModelParallelInfo, cfg: ParallelConfig) -> Fix:
    cur = cfg
    for _ in range(len(RULES) + len(_POSITIVE_FIELDS)):
        if _is_valid(model, cur):
            break
        nxt = _repair_step(model, cur)
        if nxt is None:
            cur = _safe_config(model, cur)
            break
        cur = nxt
    if not _is_valid(model, cur):  # pragma: no cover - the loop above always converges; belt and braces
        cur = _safe_config(model, cfg)
    changes = [(FLAGS[name], getattr(cur, name)) for name in _changed_fields_in_order(model, cfg, cur)]
    alone = len(changes) == 1
    parts = [_describe(flag, new, getattr(cfg, _FIELD_OF_FLAG[flag]), cfg, alone) for flag, new in changes]
    text = " and ".join(parts)
    text = text[0].upper() + text[1:] + "."
    (flag, value), *rest = changes
    return Fix(flag=flag, value=value, text=text, also=tuple(rest))


def _changed_fields_in_order(model: ModelParallelInfo, old: ParallelConfig, new: ParallelConfig) -> list[str]:
    # Put the field the first failing rule is about first; then the rest in field order.
    names = [f.name for f in dataclasses.fields(ParallelConfig) if getattr(old, f.name) != getattr(new, f.name)]
    failure = _first_failure(model, old)
    primary_order = {
        "tp_divisible_by_dcp": "decode_context_parallel_size",
        "dcp_max_size": "decode_context_parallel_size",
        "dcp_q_per_kv": "decode_context_parallel_size",
        "dcp_sliding_window": "decode_context_parallel_size",
        "dcp_group_kv_head": "decode_context_parallel_size",
        "heads_divisible_by_tp": "tensor_parallel_size",
        "dcp_tp_gt_kv_heads": "tensor_parallel_size",
        "kv_heads_split": "tensor_parallel_size",
        "interleave_block_size": "dcp_kv_cache_interleave_size",
    }
    if failure is not None:
        first = failure[2] or primary_order.get(failure[0])
        if first in names:
            names.remove(first)
            names.insert(0, first)
    return names


# --------------------------------------------------------------------------------------------------------------
# Public checks
# --------------------------------------------------------------------------------------------------------------


def check_parallel_config(model: ModelParallelInfo, cfg: ParallelConfig) -> Verdict:
    """Check ``cfg`` for ``model``; never raises for a bad config (see validate_parallel_config for that)."""
    failure = _first_failure(model, cfg)
    if failure is None:
        return Verdict(
            valid=True,
            message=(
                f"valid: tensor_parallel_size={cfg.tensor_parallel_size} "
                f"decode_context_parallel_size={cfg.decode_context_parallel_size} "
                f"pipeline_parallel_size={cfg.pipeline_parallel_size} "
                f"dcp_kv_cache_interleave_size={cfg.dcp_kv_cache_interleave_size} "
                f"block_size={cfg.block_size} for a {model.kind} model with "
                f"{model.num_attention_heads} attention heads and {model.num_kv_heads} KV heads"
            ),
        )
    rule, message, _ = failure
    return Verdict(valid=False, message=message, fix=_suggest_fix(model, cfg), rule=rule)


def validate_parallel_config(model: ModelParallelInfo, cfg: ParallelConfig) -> None:
    """Raise ParallelConfigError for the first failing rule (vLLM's order); return None when valid."""
    v = check_parallel_config(model, cfg)
    if not v.valid:
        raise ParallelConfigError(v.message, v.fix, v.rule)


# --------------------------------------------------------------------------------------------------------------
# Layout helpers (docs/DESIGN.md "KV cache layout", which follows vLLM)
# --------------------------------------------------------------------------------------------------------------


def _need_pos(name: str, v: Any) -> None:
    if not _is_pos_int(v):
        raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _need_rank(name: str, rank: Any, size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{name} must be in [0, {size}), got {rank!r}")


def kv_heads_for_tp_rank(total_kv_heads: int, tp: int, rank: int) -> list[int]:
    """Global KV-head ids held by TP rank ``rank``.

    tp <= kv: a contiguous slice of kv/tp heads. tp > kv: exactly one head, ``rank * kv // tp``, so consecutive
    ranks (and therefore a DCP group) share it (vLLM's ``tp_rank // num_kv_head_replicas``).
    """
    _need_pos("total_kv_heads", total_kv_heads)
    _need_pos("tp", tp)
    _need_rank("rank", rank, tp)
    if total_kv_heads % tp != 0 and tp % total_kv_heads != 0:
        raise ValueError(f"KV heads ({total_kv_heads}) cannot be split evenly across TP={tp}")
    if tp <= total_kv_heads:
        per = total_kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * total_kv_heads // tp]


def num_local_kv_heads(total_kv_heads: int, tp: int) -> int:
    """KV heads in each rank's cache tensor (vLLM's ``max(1, kv // tp)``)."""
    return len(kv_heads_for_tp_rank(total_kv_heads, tp, 0))


def q_heads_for_tp_rank(total_heads: int, tp: int, rank: int) -> list[int]:
    """Global query-head ids held by TP rank ``rank``: ``[rank*H/tp, (rank+1)*H/tp)``."""
    _need_pos("total_heads", total_heads)
    _need_pos("tp", tp)
    _need_rank("rank", rank, tp)
    if total_heads % tp != 0:
        raise ValueError(f"attention heads ({total_heads}) must be divisible by TP={tp}")
    per = total_heads // tp
    return list(range(rank * per, (rank + 1) * per))


def dcp_rank_of(tp_rank: int, dcp: int) -> int:
    """DCP rank of a TP rank: DCP groups are runs of ``dcp`` consecutive TP ranks."""
    _need_pos("dcp", dcp)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
        raise ValueError(f"tp_rank must be a non-negative integer, got {tp_rank!r}")
    return tp_rank % dcp


def dcp_group_ranks(tp_rank: int, dcp: int) -> list[int]:
    """TP ranks in the same DCP group as ``tp_rank`` (ordered by DCP rank)."""
    _need_pos("dcp", dcp)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
        raise ValueError(f"tp_rank must be a non-negative integer, got {tp_rank!r}")
    start = (tp_rank // dcp) * dcp
    return list(range(start, start + dcp))


def _need_token_args(token_pos: Any, dcp: int, interleave: int) -> None:
    _need_pos("dcp", dcp)
    _need_pos("interleave", interleave)
    if isinstance(token_pos, bool) or not isinstance(token_pos, int) or token_pos < 0:
        raise ValueError(f"token position must be a non-negative integer, got {token_pos!r}")


def dcp_owner(token_pos: int, dcp: int, interleave: int) -> int:
    """DCP rank that stores token ``token_pos``: runs of ``interleave`` tokens go round-robin over the ranks."""
    _need_token_args(token_pos, dcp, interleave)
    return (token_pos // interleave) % dcp


def dcp_local_index(token_pos: int, dcp: int, interleave: int) -> int:
    """Index of token ``token_pos`` within its owner's local token sequence."""
    _need_token_args(token_pos, dcp, interleave)
    return (token_pos // (interleave * dcp)) * interleave + token_pos % interleave


def dcp_local_count(num_tokens: int, dcp: int, interleave: int, dcp_rank: int) -> int:
    """Tokens of a ``num_tokens``-long sequence that live on ``dcp_rank`` (vLLM's get_dcp_local_seq_lens)."""
    _need_token_args(num_tokens, dcp, interleave)
    _need_rank("dcp_rank", dcp_rank, dcp)
    round_len = interleave * dcp
    full, rem = divmod(num_tokens, round_len)
    return full * interleave + min(max(rem - dcp_rank * interleave, 0), interleave)


def dcp_local_num_blocks(num_tokens: int, dcp: int, interleave: int, dcp_rank: int, block_size: int) -> int:
    """KV blocks ``dcp_rank`` needs for a sequence: ceil(local_count / block_size)."""
    _need_pos("block_size", block_size)
    return -(-dcp_local_count(num_tokens, dcp, interleave, dcp_rank) // block_size)


def kv_dtype_mismatch(
    prefill: str, decode: str, prefill_name: str = "the prefill pod", decode_name: str = "the decode pod"
) -> str | None:
    """Why KV cannot move between a prefill and a decode pod of these KV dtypes ("" = not reported); None if it can.

    The bytes are moved as they are, never converted, so both sides must store the same KV dtype: the same
    EngineConfig.dtype, or the same fp8 EngineConfig.kv_cache_dtype (whose scales travel beside the bytes)."""
    if not prefill or not decode or prefill == decode:
        return None
    if prefill.startswith("float8") or decode.startswith("float8"):
        flag = _KV_CACHE_FLAG.get(prefill, "auto")
        return (
            f"KV cache dtype mismatch: {prefill_name} stores its KV cache as {prefill}, {decode_name} as {decode}, "
            f"and the KV moves between them as raw bytes: start both with the same --kv-cache-dtype "
            f"(e.g. --kv-cache-dtype {flag} on {decode_name})"
        )
    return (
        f"KV dtype mismatch: {prefill_name} runs {prefill}, {decode_name} runs {decode}, and KV moves between "
        f"them as raw bytes: start both with the same --dtype (e.g. --dtype {prefill} on {decode_name})"
    )


# a cache dtype as --kv-cache-dtype names it (vLLM's values); a model-dtype cache is "auto"
_KV_CACHE_FLAG = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
