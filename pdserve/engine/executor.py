"""Executors run a StepInput on every rank of a pod: in-process for TP 1, a gloo/NCCL group of processes otherwise.

The engine's process is rank 0 (the driver): it schedules, broadcasts each step, runs its own slice and samples.
Ranks 1..N-1 are spawned processes that loop on the broadcast."""
from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.attention import select_backend
from pdserve.engine.model_runner import ModelRunner, StepInput
from pdserve.model.config import ModelConfig
from pdserve.model.parallel_state import ParallelState

log = logging.getLogger("pdserve.executor")


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its slice of the pod (picklable, sent to spawned ranks)."""

    model_path: str
    tp_size: int
    dcp_size: int
    interleave: int
    num_blocks: int
    block_size: int
    max_model_len: int
    device: str
    attention_backend: str | None
    init_method: str
    timeout_s: float  # of each collective
    threads_per_rank: int
    init_timeout_s: float = 600.0  # rendezvous: rank processes start slowly on a loaded host
    exact_prefill: bool = False  # EngineConfig.exact_prefill


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_rank(spec: RankSpec, rank: int) -> ModelRunner:
    torch.set_num_threads(spec.threads_per_rank)
    cfg = ModelConfig.from_path(spec.model_path)
    ps = ParallelState(tp_size=spec.tp_size, tp_rank=rank, dcp_size=spec.dcp_size, dcp_rank=rank % spec.dcp_size,
                       dcp_interleave=spec.interleave)
    if spec.tp_size > 1:
        backend_name = "nccl" if spec.device.startswith("cuda") else "gloo"
        host, _, port = spec.init_method.removeprefix("tcp://").rpartition(":")
        store = dist.TCPStore(host, int(port), spec.tp_size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=spec.init_timeout_s))
        dist.init_process_group(backend_name, store=store, world_size=spec.tp_size, rank=rank,
                                timeout=datetime.timedelta(seconds=spec.timeout_s))
        ps.tp_group = dist.group.WORLD
        # Every rank must create every group, in the same order.
        for first in range(0, spec.tp_size, spec.dcp_size):
            group = dist.new_group(list(range(first, first + spec.dcp_size)))
            if first <= rank < first + spec.dcp_size:
                ps.dcp_group = group
    device = spec.device if not spec.device.startswith("cuda") else f"cuda:{rank}"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    backend = select_backend(device, spec.attention_backend)
    return ModelRunner(spec.model_path, cfg, ps, backend, spec.num_blocks, spec.block_size, spec.max_model_len,
                       device=device, exact_prefill=spec.exact_prefill)


# Sent by an idle driver now and then (Executor.keepalive); ranks ignore it.
_PING = "ping"


@dataclass(frozen=True)
class RankCall:
    """Run fn(runner, *args) on every rank (e.g. pull this rank's share of a KV transfer); results come back."""

    fn: Callable[..., Any]
    args: tuple = ()


def _worker_main(spec: RankSpec, rank: int) -> None:
    # Ctrl-C reaches the whole foreground process group; it is the driver's to handle: it drains (the ranks still
    # compute its in-flight steps) and then stops them. (SIGTERM still ends a rank: multiprocessing's exit uses it.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner = _build_rank(spec, rank)
    box: list = [None]
    while True:
        dist.broadcast_object_list(box, src=0)
        msg = box[0]
        if msg is None:
            break
        if isinstance(msg, str):  # _PING: the driver is idle, nothing to run
            continue
        if isinstance(msg, RankCall):
            try:
                result: Any = msg.fn(runner, *msg.args)
            except Exception as e:  # reported to the driver, never kills the rank
                result = e
            dist.gather_object(result, None, dst=0)
        else:
            runner.execute(msg)
    dist.destroy_process_group()


class Executor:
    """Runs steps on all ranks of one pod; rank 0's logits come back to the engine."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.procs: list[BaseProcess] = []
        if spec.tp_size > 1:
            ctx = mp.get_context("spawn")
            for rank in range(1, spec.tp_size):
                p = ctx.Process(target=_worker_main, args=(spec, rank), daemon=True, name=f"pdserve-rank{rank}")
                p.start()
                self.procs.append(p)
        self.runner = _build_rank(spec, 0)
        self._last_broadcast = time.monotonic()

    @classmethod
    def create(cls, model_path: str, tp_size: int, dcp_size: int, interleave: int, num_blocks: int, block_size: int,
               max_model_len: int, device: str = "cpu", attention_backend: str | None = None,
               timeout_s: float = 120.0, exact_prefill: bool = False) -> "Executor":
        cores = os.cpu_count() or 1
        spec = RankSpec(model_path, tp_size, dcp_size, interleave, num_blocks, block_size, max_model_len, device,
                        attention_backend, f"tcp://127.0.0.1:{_free_port()}", timeout_s,
                        threads_per_rank=max(1, torch.get_num_threads() if tp_size == 1 else cores // tp_size),
                        exact_prefill=exact_prefill)
        return cls(spec)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    def execute(self, step: StepInput) -> torch.Tensor:
        if self.spec.tp_size > 1:
            dist.broadcast_object_list([step], src=0)
            self._last_broadcast = time.monotonic()
        return self.runner.execute(step)

    def call_all_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(runner, *args) on every rank, rank 0 included; returns results in rank order (exceptions as values)."""
        try:
            mine: Any = fn(self.runner, *args)
        except Exception as e:
            mine = e
        if self.spec.tp_size == 1:
            return [mine]
        dist.broadcast_object_list([RankCall(fn, args)], src=0)
        self._last_broadcast = time.monotonic()
        out: list[Any] = [None] * self.spec.tp_size
        dist.gather_object(mine, out, dst=0)
        return out

    def keepalive(self) -> None:
        """Call from the driver's loop while it is idle: now and then broadcast a no-op. Ranks 1..N-1 wait for the
        next step inside a collective, which the process group aborts after ``timeout_s`` (gloo: "Timed out waiting
        for recv"), killing the rank: without this, a TP pod idle for ``timeout_s`` loses its ranks."""
        if self.spec.tp_size > 1 and time.monotonic() - self._last_broadcast > self.spec.timeout_s / 4:
            dist.broadcast_object_list([_PING], src=0)
            self._last_broadcast = time.monotonic()

    def workers_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def shutdown(self) -> None:
        if self.spec.tp_size > 1 and dist.is_initialized():
            try:
                if self.workers_alive():
                    dist.broadcast_object_list([None], src=0)
            finally:
                dist.destroy_process_group()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.procs = []
