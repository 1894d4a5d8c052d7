"""How a request's prompt KV gets into a decode pod's blocks.

A KVSource is a small picklable object that is sent to every rank of the pod, to the rank's KV-connector worker
``DecodeKVConnector`` (pdserve/engine/kv_connector.py, its ``deliver`` operation); on each rank
``write_rank(conn, block_table)`` writes exactly that rank's share (its DCP tokens, its KV heads) into the rank's
cache at the blocks the pod reserved for it, and returns the bytes written.

* TransferKVSource: the real path, a kv_transfer KVPuller on each rank, held by the rank's connector
  (``puller.pull(handoff, block_table)``).
* DenseKVSource / FileKVSource: the whole prompt KV as one tensor [layers, 2, tokens, kv_heads, head_dim] (post-RoPE
  K, as every cache holds it), e.g. computed by a reference engine with ``prompt_kv_from_engine``. Tests and offline
  tools use these until a prefill pod is involved; the pod code path (reserve -> deliver -> kv_landed) is the same.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import grpc
import torch

from pdserve.engine.block_manager import dcp_slot
from pdserve.engine.kv_connector import KVConnectorSpec, KVConnectorWorker
from pdserve.errors import ServiceError

if TYPE_CHECKING:  # pragma: no cover
    from pdserve.engine.executor import Executor
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.security import TLSConfig


class KVDeliveryError(ServiceError):
    """Some rank could not write its share of the prompt KV (ABORTED unless the cause says otherwise)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.ABORTED) -> None:
        super().__init__(code, message)


@runtime_checkable
class KVSource(Protocol):
    num_tokens: int

    def write_rank(self, conn: "DecodeKVConnector", block_table: list[int]) -> int:
        """Runs on every rank (in the rank's process): copy this rank's tokens/heads into block_table."""
        ...


def rank_token_slots(runner: "ModelRunner", num_tokens: int,
                     block_table: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(absolute positions this rank stores, their flat cache slots) for the first num_tokens tokens."""
    ps, bs = runner.ps, runner.block_size
    pos, slots = [], []
    for t in range(num_tokens):
        owner, li = dcp_slot(t, ps.dcp_size, ps.dcp_interleave)
        if owner == ps.dcp_rank:
            pos.append(t)
            slots.append(block_table[li // bs] * bs + li % bs)
    return torch.tensor(pos, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)


def rank_kv_heads(runner: "ModelRunner") -> list[int]:
    """Global KV head ids this rank stores (vLLM placement, replicated when TP exceeds the KV heads)."""
    return list(runner.model.layers[0].self_attn.kv_heads)


def write_dense(runner: "ModelRunner", kv: torch.Tensor, block_table: list[int]) -> int:
    """kv: [layers, 2, tokens, total_kv_heads, head_dim] -> this rank's cache."""
    cache = runner.kv_cache
    layers, _, nb, bs, h_local, d = cache.shape
    if kv.dim() != 5 or kv.shape[0] != layers or kv.shape[1] != 2 or kv.shape[4] != d:
        raise KVDeliveryError(f"prompt KV has shape {tuple(kv.shape)}, this pod's cache needs "
                              f"[{layers}, 2, tokens, {runner.cfg.num_kv_heads}, {d}]",
                              grpc.StatusCode.INVALID_ARGUMENT)
    if kv.shape[3] != runner.cfg.num_kv_heads:
        raise KVDeliveryError(f"prompt KV has {kv.shape[3]} KV heads, the model has {runner.cfg.num_kv_heads}",
                              grpc.StatusCode.INVALID_ARGUMENT)
    pos, slots = rank_token_slots(runner, kv.shape[2], block_table)
    heads = torch.tensor(rank_kv_heads(runner), dtype=torch.int64)
    part = kv.index_select(2, pos).index_select(3, heads).to(cache.device, cache.dtype)
    flat = cache.view(layers, 2, nb * bs, h_local, d)
    flat[:, :, slots.to(cache.device)] = part
    return part.numel() * part.element_size()


@dataclass(frozen=True)
class DenseKVSource:
    kv: torch.Tensor  # [layers, 2, tokens, total_kv_heads, head_dim]

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[2])

    def write_rank(self, conn: "DecodeKVConnector", block_table: list[int]) -> int:
        return write_dense(conn.runner, self.kv, block_table)

    def save(self, path: str) -> None:
        torch.save({"kv": self.kv.contiguous()}, path)


@dataclass(frozen=True)
class FileKVSource:
    """A DenseKVSource saved with DenseKVSource.save; every rank maps the file itself (nothing big is broadcast)."""

    path: str
    num_tokens: int

    def write_rank(self, conn: "DecodeKVConnector", block_table: list[int]) -> int:
        try:
            kv = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)["kv"]
        except (OSError, RuntimeError, KeyError) as e:
            raise KVDeliveryError(f"cannot read prompt KV from {self.path}: {e}", grpc.StatusCode.NOT_FOUND) from e
        if kv.shape[2] != self.num_tokens:
            raise KVDeliveryError(f"{self.path} holds KV for {kv.shape[2]} tokens, the prompt has {self.num_tokens}",
                                  grpc.StatusCode.INVALID_ARGUMENT)
        return write_dense(conn.runner, kv, block_table)


# --- the real transfer: one kv_transfer KVPuller per rank, created in the rank's own process ---


@dataclass(frozen=True)
class TransferKVSource:
    """``puller_factory(runner)`` builds the rank's KVPuller once per connector (it registers runner.kv_cache);
    ``handoff_json`` is a kv_transfer KVHandoff. Any kv_transfer error is raised with its status code."""

    handoff_json: str
    num_tokens: int
    puller_factory: Callable[["ModelRunner"], Any]
    timeout_s: float | None = None

    def keepalive(self, conn: "DecodeKVConnector") -> None:
        """Renew the prefill lease while the request waits for decode blocks (rank 0, in the pod's process)."""
        from kv_transfer.transport import KVHandoff

        conn.puller(self.puller_factory).renew(KVHandoff.from_json(self.handoff_json))

    def write_rank(self, conn: "DecodeKVConnector", block_table: list[int]) -> int:
        from kv_transfer.transport import KVHandoff, KVTransferError, grpc_status_code

        runner = conn.runner
        puller = conn.puller(self.puller_factory)
        try:
            handoff = KVHandoff.from_json(self.handoff_json)
            return int(puller.pull(handoff, block_table, timeout_s=self.timeout_s).nbytes)
        except Exception as e:
            code = grpc_status_code(e) if isinstance(e, KVTransferError) else grpc.StatusCode.ABORTED
            raise KVDeliveryError(f"KV transfer failed on rank {runner.ps.tp_rank}: {e}", code) from e


@dataclass(frozen=True)
class PullerFactory:
    """Builds a decode rank's kv_transfer puller over its cache (picklable; called in the rank's process)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    tp_size: int
    dcp_size: int
    interleave: int
    num_blocks: int
    backend: str = "auto"  # kv_transfer.factory: "auto" (NIXL if usable, else TCP), "nixl", "tcp"
    auth_token: str = ""  # the cluster token presented to prefill pods' KV endpoints ("" = none)
    tls: "TLSConfig | None" = None  # the pod's TLS settings, used to dial those endpoints

    @classmethod
    def for_engine(cls, engine: "LLMEngine", backend: str = "auto", auth_token: str = "",
                   tls: "TLSConfig | None" = None) -> "PullerFactory":
        mc, cfg, cache = engine.model_config, engine.config, engine.executor.kv_cache
        return cls(mc.num_layers, mc.num_kv_heads, mc.head_dim, str(cache.dtype).removeprefix("torch."),
                   cfg.block_size, cfg.tensor_parallel_size, cfg.decode_context_parallel_size,
                   cfg.dcp_kv_cache_interleave_size, cfg.num_kv_blocks, backend, auth_token, tls)

    def layout(self):
        from kv_transfer.layout import KVLayout

        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                        dtype=self.dtype, block_size=self.block_size, tp_size=self.tp_size, dcp_size=self.dcp_size,
                        interleave=self.interleave, num_blocks=self.num_blocks)

    def __call__(self, runner: "ModelRunner") -> Any:
        from kv_transfer.factory import make_puller

        return make_puller(self.layout(), runner.ps.tp_rank, runner.kv_cache, backend=self.backend,
                           auth_token=self.auth_token, tls=self.tls)


class DecodeKVConnector(KVConnectorWorker):
    """A decode rank's KV-connector worker: writes arriving prompt KV (``deliver``) and holds the rank's pullers."""

    def __init__(self, runner: "ModelRunner") -> None:
        super().__init__(runner)
        self.pullers: dict[Any, Any] = {}  # puller factory -> its puller over this rank's cache

    def puller(self, factory: Callable[["ModelRunner"], Any]) -> Any:
        p = self.pullers.get(factory)
        if p is None:
            p = self.pullers[factory] = factory(self.runner)
        return p

    def deliver(self, source: KVSource, tables: list[list[int]]) -> int:
        """Write this rank's share of source (tables: one block table per DCP rank); the bytes written."""
        return source.write_rank(self, tables[self.runner.ps.dcp_rank])

    def close(self) -> None:
        for p in self.pullers.values():
            try:
                p.close()
            except Exception:  # closing is best effort: the rank is going away
                pass
        self.pullers.clear()


def decode_connector(executor: "Executor") -> DecodeKVConnector:
    """Rank 0's DecodeKVConnector, built on every rank on first use."""
    conn = executor.runner.kv_connector
    if conn is None:
        errs = [r for r in executor.start_kv_connector(KVConnectorSpec(DecodeKVConnector))
                if isinstance(r, BaseException)]
        if errs:
            executor.connector_call("close")
            raise KVDeliveryError(f"starting the KV connector failed: {errs[0]!r}")
        conn = executor.runner.kv_connector
    assert isinstance(conn, DecodeKVConnector)
    return conn


def deliver(executor: "Executor", source: KVSource, tables: list[list[int]]) -> tuple[list[int], float]:
    """Have every rank write its share (tables: one block table per DCP rank). Returns (bytes per rank, seconds);
    raises KVDeliveryError naming the first rank that failed."""
    t0 = time.perf_counter()
    decode_connector(executor)
    results = executor.connector_call("deliver", source, tables)
    for rank, r in enumerate(results):
        if isinstance(r, BaseException):
            if isinstance(r, KVDeliveryError):
                raise r
            raise KVDeliveryError(f"rank {rank} could not write its KV: {type(r).__name__}: {r}")
    return [int(r) for r in results], time.perf_counter() - t0


# --- a stand-in prefill pod: any LLMEngine computes the prompt's KV and first token ---
def _read_rank_kv(runner: "ModelRunner", table: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    cache = runner.kv_cache
    layers, _, nb, bs, h, d = cache.shape
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(num_tokens)], dtype=torch.int64)
    return rank_kv_heads(runner), cache.view(layers, 2, nb * bs, h, d)[:, :, slots].cpu().clone()


def prompt_kv_from_engine(engine: "LLMEngine", prompt_ids: list[int]) -> tuple[DenseKVSource, int, float]:
    """Prefill prompt_ids greedily on engine (DCP 1, any TP): (its KV as a DenseKVSource, first token, logprob).

    This is what a prefill pod hands over; tests use it so that the decode pod receives KV computed by the engine
    through the same delivery path a real transfer uses."""
    from pdserve.sampling import SamplingParams

    if engine.config.decode_context_parallel_size != 1:
        raise ValueError("prompt_kv_from_engine needs an engine with DCP 1")
    rid = f"prefill-ref-{id(prompt_ids)}-{time.monotonic_ns()}"
    engine.add_request(list(prompt_ids), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), rid)
    first: tuple[int, float] | None = None
    try:
        while first is None:
            for out in engine.step():
                if out.request_id == rid:
                    first = (out.new_token_ids[0], out.new_logprobs[0])
        seq = next(s for s in engine.scheduler.running if s.request_id == rid)
        n = len(prompt_ids)
        parts = engine.executor.call_all_ranks(_read_rank_kv, seq.block_tables[0], n)
    finally:
        engine.abort(rid)
    mc = engine.model_config
    kv = torch.empty(mc.num_layers, 2, n, mc.num_kv_heads, mc.head_dim, dtype=engine.executor.kv_cache.dtype)
    for p in parts:
        if isinstance(p, BaseException):
            raise p
        heads, t = p
        kv[:, :, :, heads] = t.to(kv.dtype)
    return DenseKVSource(kv), first[0], first[1]
