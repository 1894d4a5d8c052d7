"""Executors run a StepInput on every rank of a pod: in-process for TP 1, a group of processes otherwise.

The engine's process is rank 0 (the driver): it schedules, broadcasts each step, runs its own slice and samples.
Ranks 1..N-1 are spawned processes that loop on the broadcast. Between ranks on one CPU host the collectives and
the step broadcast go through shared memory (pdserve/engine/comm.py, ``cpu_collectives="shm"``, the default);
``"gloo"`` keeps torch.distributed's gloo; CUDA ranks use NCCL."""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve import kernels
from pdserve.attention import select_backend
from pdserve.engine.comm import ShmComm, ShmGroupSpec, TorchComm, init_groups, plan_groups
from pdserve.engine.config import CPU_COLLECTIVES, CPU_PINNING
from pdserve.engine.kv_connector import KVConnectorSpec, KVConnectorWorker
from pdserve.engine.model_runner import ModelRunner, StepInput
from pdserve.engine.shm import RankFailure, ShmRegion, proc_state, shm_supported
from pdserve.heap import freeze_startup_heap
from pdserve.model.config import ModelConfig
from pdserve.model.parallel_state import ParallelState
from pdserve.net import free_port

log = logging.getLogger("pdserve.executor")
STACKS_SIGNAL = signal.SIGUSR1  # a rank's threads' stacks, to its stderr (faulthandler)

# A slot holds one rank's share of a collective for this many tokens (at most _SLOT_CAP bytes); larger steps go
# through in pieces.
_SLOT_TOKENS = 1024
_SLOT_CAP = 8 << 20


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
    dtype: str = "float32"  # of weights, activations and KV cache (EngineConfig.dtype, resolved)
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype: "auto" keeps the KV in dtype
    quantization: str = "none"  # EngineConfig.quantization
    collectives: str = "gloo"  # "shm" | "gloo" | "nccl" (resolved by Executor.create)
    shm: ShmRegion | None = None  # the pod's shared region (collectives == "shm")
    shm_world: ShmGroupSpec | None = None
    shm_dcp: tuple[ShmGroupSpec, ...] = ()
    cpus: tuple[int, ...] | None = None  # pin rank r to cpus[r % len(cpus)] (None: no pinning)


def resolve_collectives(requested: str, device: str, tp_size: int) -> tuple[str, str]:
    """(backend, why) for a pod's ranks: NCCL on GPU; on CPU shared memory unless gloo is asked for or the host
    cannot do it."""
    if requested not in CPU_COLLECTIVES:
        raise ValueError(f"cpu_collectives must be one of {', '.join(CPU_COLLECTIVES)}, got {requested!r}")
    if device.startswith("cuda"):
        return "nccl", "CUDA ranks"
    if tp_size == 1:
        return "none", "TP 1"
    problem = shm_supported()
    if requested == "shm" and problem:
        raise ValueError(f"cpu_collectives=shm {problem}; use cpu_collectives=gloo")
    if requested == "gloo":
        return "gloo", "asked for (cpu_collectives=gloo)"
    if problem:
        return "gloo", f"shared memory unavailable: {problem}"
    return "shm", "CPU ranks on one host"


def resolve_pinning(requested: str, device: str, tp_size: int, cores: int, threads: int = 1) -> tuple[bool, str]:
    """Pin rank r to one core when ranks outnumber cores: a rank woken by a collective otherwise tends to be queued
    on the waker's core (wake-affine) while another core idles. A single rank pins its compute threads one per core
    (as vLLM's CPU worker does) for the same reason: two unpinned threads often share a core."""
    if requested not in CPU_PINNING:
        raise ValueError(f"cpu_pinning must be one of {', '.join(CPU_PINNING)}, got {requested!r}")
    if device.startswith("cuda"):
        return False, "not a CPU pod"
    if tp_size == 1:
        if requested == "off" or threads < 2:
            return False, "cpu_pinning=off" if requested == "off" else "one compute thread"
        if requested == "auto" and threads > cores:
            return False, f"{threads} threads > {cores} cores"
        return True, f"{threads} compute threads, thread t on core t"
    if requested != "auto":
        return requested == "on", f"cpu_pinning={requested}"
    if tp_size > cores:
        return True, f"{tp_size} ranks > {cores} cores"
    return False, f"{tp_size} ranks <= {cores} cores"


def _pin(spec: RankSpec, rank: int) -> None:
    if spec.cpus and spec.tp_size > 1:  # a single rank pins its thread team around each step (Executor.execute)
        os.sched_setaffinity(0, {spec.cpus[rank % len(spec.cpus)]})


def _build_rank(spec: RankSpec, rank: int) -> tuple[ModelRunner, "_Channel | None"]:
    torch.set_num_threads(spec.threads_per_rank)
    _pin(spec, rank)
    cfg = ModelConfig.from_path(spec.model_path)
    ps = ParallelState(
        tp_size=spec.tp_size,
        tp_rank=rank,
        dcp_size=spec.dcp_size,
        dcp_rank=rank % spec.dcp_size,
        dcp_interleave=spec.interleave,
    )
    channel: _Channel | None = None
    if spec.collectives == "shm":
        assert spec.shm is not None and spec.shm_world is not None
        world = ShmComm(spec.shm, spec.shm_world, rank, spec.timeout_s)
        ps.tp_comm = world
        for g in spec.shm_dcp:
            if rank in g.ranks:
                ps.dcp_comm = ShmComm(spec.shm, g, rank, spec.timeout_s)
        channel = _ShmChannel(world)
    elif spec.tp_size > 1:
        host, _, port = spec.init_method.removeprefix("tcp://").rpartition(":")
        store = dist.TCPStore(
            host, int(port), spec.tp_size, is_master=rank == 0, timeout=datetime.timedelta(seconds=spec.init_timeout_s)
        )
        dist.init_process_group(
            spec.collectives,
            store=store,
            world_size=spec.tp_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
        ps.tp_comm = TorchComm(dist.group.WORLD, spec.tp_size, rank)
        # Every rank must create every group, in the same order.
        for first in range(0, spec.tp_size, spec.dcp_size):
            group = dist.new_group(list(range(first, first + spec.dcp_size)))
            if first <= rank < first + spec.dcp_size:
                ps.dcp_comm = TorchComm(group, spec.dcp_size, rank - first)
        channel = _DistChannel(spec.tp_size)
    device = spec.device if not spec.device.startswith("cuda") else f"cuda:{rank}"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    prefer = spec.attention_backend
    if (
        spec.kv_cache_dtype != "auto"
        and (prefer or ("flashinfer" if device.startswith("cuda") else "torch")) != "torch"
    ):
        # pdserve's flashinfer wrappers plan model-dtype caches only; the torch backend dequantises fp8 per block
        log.warning("kv_cache_dtype %s: attention runs on the torch backend, not %s", spec.kv_cache_dtype, prefer)
        prefer = "torch"
    backend = select_backend(device, prefer)
    runner = ModelRunner(
        spec.model_path,
        cfg,
        ps,
        backend,
        spec.num_blocks,
        spec.block_size,
        spec.max_model_len,
        device=device,
        dtype=getattr(torch, spec.dtype),
        exact_prefill=spec.exact_prefill,
        kv_cache_dtype=spec.kv_cache_dtype,
        quantization=spec.quantization,
    )
    return runner, channel


# Sent by an idle driver now and then (Executor.keepalive); ranks ignore it.
_PING = "ping"


@dataclass(frozen=True)
class RankCall:
    """Run fn(runner, *args) on every rank (e.g. pull this rank's share of a KV transfer); results come back."""

    fn: Callable[..., Any]
    args: tuple = ()


def _copy_blocks(runner: ModelRunner, per_rank: list[list[tuple[int, int]]]) -> None:
    runner.copy_blocks(per_rank[runner.ps.dcp_rank])


def _connector_start(runner: ModelRunner, spec: KVConnectorSpec) -> Any:
    return runner.start_kv_connector(spec)


def _connector_op(runner: ModelRunner, op: str, args: tuple) -> Any:
    conn = runner.kv_connector
    if op == "close":
        runner.close_kv_connector()
        return None
    if conn is None:
        raise RuntimeError(f"rank {runner.ps.tp_rank} has no KV connector to {op}")
    return getattr(conn, op)(*args)


class _DistChannel:
    """Driver -> ranks messages over torch.distributed (pickled objects)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def send(self, msg: Any, timeout_s: float | None = None) -> None:
        dist.broadcast_object_list([msg], src=0)

    def recv(self) -> Any:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        dist.destroy_process_group()


_STEP, _OBJ = b"S", b"O"


class _ShmChannel:
    """Driver -> ranks messages through the world group's shared slots: a step as its flat int64 encoding, anything
    else pickled. Idle ranks sleep in the barrier for as long as the driver lives (no keepalive needed)."""

    def __init__(self, world: ShmComm) -> None:
        self.world = world

    def send(self, msg: Any, timeout_s: float | None = None) -> None:
        data = _STEP + msg.encode() if isinstance(msg, StepInput) else _OBJ + pickle.dumps(msg)
        self.world.broadcast_bytes(data, "the step broadcast", timeout_s or self.world.timeout_s)

    def recv(self) -> Any:
        data = self.world.broadcast_bytes(None, "waiting for the driver", None)
        return StepInput.decode(data[1:]) if data[:1] == _STEP else pickle.loads(data[1:])

    def gather(self, obj: Any) -> list[Any] | None:
        parts = self.world.gather_bytes(pickle.dumps(obj), "gathering rank results")
        if parts is None:
            return None
        for rank, p in enumerate(parts):
            if not p:  # every rank sends a pickle: an empty slot is a rank that died in the gather
                self.world.barrier.check_peers("gathering rank results")
                raise RankFailure(f"TP rank {rank} sent no result: it died while the ranks gathered", rank)
        return [pickle.loads(p) for p in parts]

    def started(self, timeout_s: float) -> None:
        """Every rank, once its slice is built: the pod is up when all are (as gloo's rendezvous)."""
        self.world.barrier.wait(timeout_s, "the ranks' start-up")

    def abort(self) -> None:
        self.world.barrier.abort()

    def wait_for_shutdown(self) -> None:
        """A rank whose group broke waits to be stopped, so the pod names the rank that really failed."""
        b = self.world.barrier
        while not b.aborted:
            try:
                b.check_peers("waiting to be stopped", watch=(0,))
            except RankFailure:
                return
            time.sleep(b.SLICE_S)

    def close(self) -> None:
        pass


_Channel = _DistChannel | _ShmChannel


def _worker_main(spec: RankSpec, rank: int) -> None:
    # Ctrl-C reaches the whole foreground process group; it is the driver's to handle: it drains (the ranks still
    # compute its in-flight steps) and then stops them. (SIGTERM still ends a rank: multiprocessing's exit uses it.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGUSR1: every thread's stack into the pod's log (the driver asks when this rank misses a collective)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    runner, channel = _build_rank(spec, rank)
    assert channel is not None
    freeze_startup_heap(f"TP rank {rank}")
    try:
        if isinstance(channel, _ShmChannel):
            channel.started(spec.init_timeout_s)
        while True:
            msg = channel.recv()
            if msg is None:
                break
            if isinstance(msg, str):  # _PING: the driver is idle, nothing to run
                continue
            if isinstance(msg, RankCall):
                try:
                    result: Any = msg.fn(runner, *msg.args)
                except Exception as e:  # reported to the driver, never kills the rank
                    result = e
                channel.gather(result)
            else:
                runner.execute(msg)
    except RankFailure as e:  # the driver or a peer is gone: nothing left to serve
        log.error("TP rank %d stops: %s", rank, e)
        if isinstance(channel, _ShmChannel):
            channel.wait_for_shutdown()
        raise SystemExit(3) from None
    channel.close()


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
        # Rank 0 is this thread: its pinning and torch's thread count are given back at shutdown, so that whatever
        # this process runs next (another engine, a benchmark's next side) sees the machine as before.
        self._driver_was = (os.sched_getaffinity(0), torch.get_num_threads())
        # A single CPU rank: the thread whose OpenMP team is pinned (the one that steps; in a pod not the builder).
        self._pin_team = spec.tp_size == 1 and spec.cpus is not None and kernels.available()
        self._team_of: int | None = None
        try:
            self.runner, self.channel = _build_rank(spec, 0)
            if isinstance(self.channel, _ShmChannel):
                for rank, proc in enumerate(self.procs, start=1):
                    self.channel.world.barrier.expect(rank, proc.pid or 0)
                self.channel.started(spec.init_timeout_s)
        except BaseException:
            self._stop_procs(kill=True)
            self._restore_driver()
            raise
        self._last_broadcast = time.monotonic()
        self._broken = False

    @classmethod
    def create(
        cls,
        model_path: str,
        tp_size: int,
        dcp_size: int,
        interleave: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: str = "cpu",
        attention_backend: str | None = None,
        timeout_s: float = 120.0,
        exact_prefill: bool = False,
        cpu_collectives: str = "auto",
        cpu_pinning: str = "auto",
        dtype: str = "float32",
        kv_cache_dtype: str = "auto",
        quantization: str = "none",
    ) -> "Executor":
        allowed = sorted(os.sched_getaffinity(0))
        cores = len(allowed)
        collectives, why = resolve_collectives(cpu_collectives, device, tp_size)
        threads = max(1, torch.get_num_threads() if tp_size == 1 else cores // tp_size)
        shm = world = None
        dcp_groups: tuple[ShmGroupSpec, ...] = ()
        if collectives == "shm":
            cfg = ModelConfig.from_path(model_path)
            heads = -(-cfg.num_heads // tp_size) * dcp_size
            world_slot = min(_SLOT_CAP, 4 * _SLOT_TOKENS * cfg.hidden_size)  # fp32 hidden states
            # MLA merges decode partials in latent space (kv_lora_rank wide) and prefill ones v_head_dim wide.
            part = cfg.head_dim if cfg.mla is None else max(cfg.mla.kv_lora_rank, cfg.mla.v_head_dim)
            dcp_slot = min(_SLOT_CAP, 4 * _SLOT_TOKENS * heads * (part + 1))  # partial out + LSE
            world, dcp_list, size = plan_groups(tp_size, dcp_size, world_slot, dcp_slot)
            dcp_groups = tuple(dcp_list)
            shm = ShmRegion(size)
            init_groups(shm, [world, *dcp_groups])
        pin, pin_why = resolve_pinning(cpu_pinning, device, tp_size, cores, threads)
        cpus = tuple(allowed) if pin else None
        if tp_size == 1 and device == "cpu":
            state = "pinned" if pin else "unpinned"
            log.info("%d compute thread(s) on %d core(s); %s (%s)", threads, cores, state, pin_why)
        if tp_size > 1:
            log.info(
                "TP %d x DCP %d ranks: collectives %s (%s); %d thread(s) per rank on %d core(s); %s (%s)",
                tp_size,
                dcp_size,
                collectives,
                why,
                threads,
                cores,
                f"rank r pinned to core {list(allowed)}[r % {cores}]" if pin else "no CPU pinning",
                pin_why,
            )
        spec = RankSpec(
            model_path,
            tp_size,
            dcp_size,
            interleave,
            num_blocks,
            block_size,
            max_model_len,
            device,
            attention_backend,
            f"tcp://127.0.0.1:{free_port()}",
            timeout_s,
            threads_per_rank=threads,
            exact_prefill=exact_prefill,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization,
            collectives=collectives,
            shm=shm,
            shm_world=world,
            shm_dcp=dcp_groups,
            cpus=cpus,
        )
        try:
            return cls(spec)
        finally:
            if shm is not None:  # the spawned ranks hold their own fds now
                shm.close_fd()

    @property
    def collectives(self) -> str:
        return self.spec.collectives

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @property
    def kv_scales(self) -> torch.Tensor | None:
        """Rank 0's fp8 scales (kv_quant.py); None for a model-dtype cache."""
        return self.runner.kv_scales

    def execute(self, step: StepInput) -> torch.Tensor:
        # The stepping thread is pinned for the step only, so that threads it starts later are not born pinned.
        mask = self._pin_step() if self._pin_team else None
        try:
            if self.channel is not None:
                self.channel.send(step)
                self._last_broadcast = time.monotonic()
            logits = self.runner.execute(step)
        except RankFailure as e:
            self._broke(e)
            raise
        finally:
            if mask is not None:
                os.sched_setaffinity(0, mask)
        assert logits is not None
        return logits

    def _broke(self, e: RankFailure) -> None:
        """The ranks are out of step: shutdown stops them without a last broadcast. A rank that missed the collective
        while still running is stuck somewhere: it is asked for its threads' stacks, which land in this pod's log."""
        self._broken = True
        if e.rank is None or not 1 <= e.rank <= len(self.procs):
            return
        pid = self.procs[e.rank - 1].pid
        if pid and proc_state(pid) in ("R", "S", "D"):  # not exited, not stopped (SIGSTOP would hold the signal)
            log.error(
                "TP rank %d (pid %d) missed the collective while running: its threads' stacks follow", e.rank, pid
            )
            os.kill(pid, STACKS_SIGNAL)

    def _pin_step(self) -> set[int]:
        assert self.spec.cpus is not None
        mask = os.sched_getaffinity(0)
        if self._team_of != threading.get_ident():  # this thread's team: its threads t > 0 stay pinned
            kernels.pin_threads(self.spec.cpus[: self.spec.threads_per_rank])
            self._team_of = threading.get_ident()
        else:
            os.sched_setaffinity(0, {self.spec.cpus[0]})
        return mask

    def call_all_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(runner, *args) on every rank, rank 0 included; returns results in rank order (exceptions as values)."""
        try:
            mine: Any = fn(self.runner, *args)
        except Exception as e:
            mine = e
        if self.channel is None:
            return [mine]
        try:
            self.channel.send(RankCall(fn, args))
            self._last_broadcast = time.monotonic()
            out = self.channel.gather(mine)
        except RankFailure as e:
            self._broke(e)
            raise
        assert out is not None
        return out

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy KV blocks on every rank: copies are (DCP rank, source block, destination block); each TP rank
        applies those of its DCP rank. Raises the first rank's failure."""
        per_rank: list[list[tuple[int, int]]] = [[] for _ in range(self.spec.dcp_size)]
        for r, src, dst in copies:
            per_rank[r].append((src, dst))
        for res in self.call_all_ranks(_copy_blocks, per_rank):
            if isinstance(res, Exception):
                raise res

    def start_kv_connector(self, spec: KVConnectorSpec) -> list[Any]:
        """Build spec's connector worker on every rank; each rank's info() (exceptions as values), in rank order."""
        return self.call_all_ranks(_connector_start, spec)

    def connector_call(self, op: str, *args: Any) -> list[Any]:
        """One of KVConnectorWorker.OPS on every rank's connector; results in rank order (exceptions as values).
        "close" closes and drops the connector (ranks without one do nothing)."""
        if op not in KVConnectorWorker.OPS:
            raise ValueError(f"{op!r} is not a KV connector operation: one of {sorted(KVConnectorWorker.OPS)}")
        return self.call_all_ranks(_connector_op, op, args)

    def keepalive(self) -> None:
        """Call from the driver's loop while it is idle: now and then broadcast a no-op. Over gloo, ranks 1..N-1
        wait for the next step inside a collective, which the process group aborts after ``timeout_s`` ("Timed out
        waiting for recv"), killing the rank: without this, a TP pod idle for ``timeout_s`` loses its ranks. Over
        shared memory ranks wait as long as the driver lives, so there is nothing to do."""
        if isinstance(self.channel, _DistChannel) and time.monotonic() - self._last_broadcast > self.spec.timeout_s / 4:
            self.channel.send(_PING)
            self._last_broadcast = time.monotonic()

    def workers_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def shutdown(self) -> None:
        try:
            if isinstance(self.channel, _DistChannel) and dist.is_initialized():
                try:
                    if self.workers_alive():
                        self.channel.send(None)
                finally:
                    self.channel.close()
            elif isinstance(self.channel, _ShmChannel):
                try:
                    if self.workers_alive() and not self._broken:
                        self.channel.send(None, timeout_s=10.0)
                except RankFailure as e:
                    log.warning("stopping the TP ranks: %s", e)
                self.channel.abort()  # a rank stuck in a collective gives up at once
        finally:
            self.channel = None
            self._stop_procs()
            self._restore_driver()

    def _restore_driver(self) -> None:
        cpus, threads = self._driver_was
        if self._team_of == threading.get_ident():
            kernels.pin_threads(sorted(cpus), one_each=False)
        if self.spec.cpus and self.spec.tp_size > 1:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)

    def _stop_procs(self, kill: bool = False) -> None:
        for p in self.procs:
            if kill:
                p.kill()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []
