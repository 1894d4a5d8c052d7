"""Helpers for router tests: an in-process router on an ephemeral loopback port, registration messages."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import grpc
from google.protobuf.message import Message

from pdserve_api.v1 import common_pb2, registry_pb2, registry_pb2_grpc, router_pb2_grpc
from router.config import RouterConfig
from router.core import RouterCore
from router.server import RouterServer


class FakeClock:
    """Registry time for heartbeat tests (the router itself runs in real time)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@contextlib.asynccontextmanager
async def running_router(clock=None, **kw) -> AsyncIterator[tuple[RouterServer, grpc.aio.Channel]]:
    kw.setdefault("port", 0)
    cfg = RouterConfig(**kw)
    core = RouterCore(cfg, clock=clock) if clock is not None else RouterCore(cfg)
    server = RouterServer(cfg, core)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, channel
    finally:
        await channel.close()
        await server.stop(grace=0.2)


def stubs(channel):
    return router_pb2_grpc.RouterStub(channel), registry_pb2_grpc.RegistryStub(channel)


def register_request(
    pod_id: str,
    role: int = common_pb2.ROLE_DECODE,
    tp: int = 1,
    dcp: int = 1,
    heads: int = 8,
    kv_heads: int = 2,
    num_blocks: int = 100,
    free: list[int] | None = None,
    model: str = "SmolLM2-135M-Instruct",
    block_size: int = 16,
    max_model_len: int = 2048,
    address: str | None = None,
    **extra,
) -> registry_pb2.RegisterWorkerRequest:
    free = free if free is not None else [num_blocks] * tp
    req = registry_pb2.RegisterWorkerRequest(
        pod_id=pod_id,
        role=role,
        address=address or f"127.0.0.1:1{abs(hash(pod_id)) % 1000:03d}",
        kv_transfer_address="127.0.0.1:9" if role == common_pb2.ROLE_PREFILL else "",
        model=model,
        model_shape=common_pb2.ModelShape(
            architecture="LlamaForCausalLM",
            num_layers=2,
            hidden_size=64,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=16,
            vocab_size=256,
            max_model_len=max_model_len,
            dtype="float32",
        ),
        parallel=common_pb2.ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
        kv_layout=common_pb2.KVLayout(
            num_layers=2,
            block_size=block_size,
            num_kv_heads=kv_heads,
            head_dim=16,
            dtype="float32",
            tp_size=tp,
            dcp_size=dcp,
            num_blocks=num_blocks,
        ),
        capacity=common_pb2.WorkerCapacity(max_num_seqs=32, max_model_len=max_model_len),
        kv=[common_pb2.RankKVStats(rank=r, free_blocks=f, total_blocks=num_blocks) for r, f in enumerate(free)],
    )
    for k, v in extra.items():
        if isinstance(v, Message):  # a message field is copied in, never assigned
            getattr(req, k).CopyFrom(v)
        else:
            setattr(req, k, v)
    return req


def run(coro):
    return asyncio.run(coro)
