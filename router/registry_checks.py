"""Field checks of the Registry RPCs (RegisterWorker, Heartbeat): what a pod reports is used for placement and shown
by ClusterStatus, so numbers that cannot be true (negative blocks, more free blocks than exist, unknown enum values,
ranks that do not exist) are refused instead of stored. Each check returns a message naming the field and the
allowed range, or None."""

from __future__ import annotations

import math
from typing import Iterable

from pdserve_api.v1 import common_pb2, registry_pb2
from router.local_prefill import profile_problem

MAX_POD_ID_LEN = 253  # a Kubernetes pod name's limit
_POD_STATES = set(common_pb2.PodState.values())
_MODES = set(common_pb2.TransferMode.values())


def pod_id_problem(pod_id: str) -> str | None:
    if not pod_id:
        return "pod_id is empty: give every pod a unique, stable id"
    if len(pod_id) > MAX_POD_ID_LEN or not pod_id.isprintable() or pod_id != pod_id.strip():
        return (
            f"pod_id {pod_id[:80]!r} must be 1..{MAX_POD_ID_LEN} printable characters without surrounding "
            "spaces (e.g. the k8s pod name)"
        )
    return None


def address_problem(field: str, address: str) -> str | None:
    """``host:port`` (IPv6 hosts in brackets), port 1..65535."""
    host, sep, port = address.rpartition(":")
    if (
        not sep
        or not host
        or not port.isdigit()
        or not 1 <= int(port) <= 65535
        or not address.isprintable()
        or any(c.isspace() for c in address)
    ):
        return f"{field} {address[:80]!r} is not host:port (port 1..65535)"
    return None


def kv_stats_problem(field: str, kv: Iterable[common_pb2.RankKVStats], tp: int) -> str | None:
    """Per-rank stats: empty (not reported), or exactly ranks 0..tp-1 with 0 <= free_blocks <= total_blocks."""
    stats = list(kv)
    if not stats:
        return None
    ranks = sorted(s.rank for s in stats)
    if ranks != list(range(tp)):
        return f"{field} must list ranks 0..{tp - 1} once each (tensor_parallel_size {tp}), got {ranks[:16]}"
    for s in stats:
        if s.total_blocks < 0 or not 0 <= s.free_blocks <= s.total_blocks:
            return (
                f"{field}[rank {s.rank}]: need 0 <= free_blocks <= total_blocks, got free {s.free_blocks} "
                f"of {s.total_blocks}"
            )
    return None


def load_problem(load: common_pb2.LoadStats) -> str | None:
    for name in ("queued_prompt_tokens", "num_running_seqs", "num_waiting_seqs", "num_active_leases"):
        if getattr(load, name) < 0:
            return f"load.{name} must be >= 0, got {getattr(load, name)}"
    for name in ("generation_tokens_per_s", "prompt_tokens_per_s"):
        v = getattr(load, name)
        if not math.isfinite(v) or v < 0:
            return f"load.{name} must be a finite number >= 0, got {v}"
    return None


def register_problem(req: registry_pb2.RegisterWorkerRequest) -> str | None:
    """Field checks of RegisterWorker that need no other pod (the parallel / shape rules come after)."""
    problem = pod_id_problem(req.pod_id) or address_problem("address", req.address)
    if problem:
        return problem
    for part in filter(None, req.kv_transfer_address.split(",")):
        problem = address_problem("kv_transfer_address", part)
        if problem:
            return problem
    lay = req.kv_layout
    for name in (
        "num_layers",
        "block_size",
        "num_kv_heads",
        "head_dim",
        "tp_size",
        "dcp_size",
        "dcp_kv_cache_interleave_size",
        "pipeline_parallel_size",
        "num_blocks",
        "num_kv_heads_per_rank",
        "element_size",
    ):
        if getattr(lay, name) < 0:
            return f"kv_layout.{name} must be >= 0 (0: not reported), got {getattr(lay, name)}"
    if req.HasField("step_profile"):
        problem = profile_problem(req.step_profile)
        if problem:
            return problem
    cap = req.capacity
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_concurrent_transfers"):
        if getattr(cap, name) < 0:
            return f"capacity.{name} must be >= 0 (0: not reported), got {getattr(cap, name)}"
    bad_modes = [m for m in cap.transfer_modes if m not in _MODES or m == common_pb2.TRANSFER_MODE_UNSPECIFIED]
    if bad_modes:
        return f"capacity.transfer_modes has unknown values {bad_modes[:8]}: use TransferMode values"
    return None


def heartbeat_problem(req: registry_pb2.HeartbeatRequest, tp: int) -> str | None:
    if req.state not in _POD_STATES:
        return f"state {req.state} is not a PodState"
    return load_problem(req.load) or kv_stats_problem("kv", req.kv, tp)
