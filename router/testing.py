"""Test / benchmark utility: a real pdserve cluster on loopback, as separate processes (``python -m router``,
``python -m prefill_svc``, ``python -m decode_svc``). Used by tests/router's end-to-end tests and bench/router.py.

Pods register themselves with the router (``--router``). Where a service cannot yet (asked of its config class),
``Cluster`` can register it on its behalf from its command line (``stand_in_registration=True``): a stand-in
registrar that sends the pod's real shape, parallel config and layout but no load or KV statistics (it cannot see
them), so the router places on that pod blind. It exists only to exercise the real pod before the service grows its
own registration, and says so in ``Cluster.notes``.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

import grpc

from pdserve.security import TLSConfig, sync_channel
from pdserve_api.v1 import common_pb2, registry_pb2, registry_pb2_grpc, router_pb2, router_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


def supports_flag(module: str, flag: str) -> bool:
    """Whether ``python -m module`` takes ``flag``: asked of its config class (pdserve.cli_config)."""
    from decode_svc.config import DecodeConfig
    from pdserve.cli_config import flags_of
    from prefill_svc.config import PrefillConfig
    from router.config import RouterConfig

    classes: dict[str, type] = {"decode_svc": DecodeConfig, "prefill_svc": PrefillConfig, "router": RouterConfig}
    return flag in flags_of(classes[module])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 shared cores: one thread per process
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    port: int = 0

    def running(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"  [{self.name}] {line}" for line in lines[-n:])


@dataclass
class Cluster:
    workdir: Path
    model: Path
    num_prefill: int = 2
    num_decode: int = 2
    prefill_tp: int = 1
    decode_tp: int = 2
    decode_dcp: int = 2
    num_kv_blocks: int = 256
    heartbeat_interval_s: float = 0.25
    router_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    stand_in_registration: bool = False
    client_tls: "TLSConfig | None" = None  # how this harness reaches a router started with --tls-* flags
    api_key: str = ""  # sent to a router started with --api-key
    procs: dict[str, Proc] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    router_port: int = 0
    _stand_ins: list["_StandInRegistrar"] = field(default_factory=list)

    # --- start / stop ---
    def _spawn(self, name: str, args: list[str]) -> Proc:
        log = self.workdir / f"{name}.log"
        f = open(log, "w")
        p = subprocess.Popen([sys.executable, "-u", "-m", *args], cwd=REPO, env=_env(), stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
        proc = Proc(name, p, log)
        self.procs[name] = proc
        return proc

    def _wait_for(self, proc: Proc, pattern: str, timeout: float) -> re.Match:
        t0 = time.monotonic()
        rx = re.compile(pattern)
        while time.monotonic() - t0 < timeout:
            m = rx.search(proc.log.read_text(errors="replace"))
            if m:
                return m
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"{proc.name} did not print {pattern!r} within {timeout}s:\n{proc.tail()}")

    def start(self, timeout: float = 240.0) -> "Cluster":
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> "Cluster":
        interval = self.heartbeat_interval_s
        r = self._spawn("router", self._router_argv(0))
        self.router_port = int(self._wait_for(r, r"listening on [\d.]+:(\d+)", timeout).group(1))
        r.port = self.router_port
        router_addr = f"127.0.0.1:{self.router_port}"
        decode_registers = supports_flag("decode_svc", "--router")
        if not decode_registers:
            if not self.stand_in_registration:
                raise RuntimeError("decode_svc has no --router flag: decode pods cannot register with the router")
            self.notes.append("decode pods registered by the harness's stand-in registrar "
                              "(decode_svc has no --router flag yet): no load / KV stats from them")
        for i in range(self.num_prefill):
            self._spawn(f"p{i}", ["prefill_svc", "--model", str(self.model), "--port", "0", "--pod-id", f"p{i}",
                                  "--router", router_addr, "-tp", str(self.prefill_tp), "--num-kv-blocks",
                                  str(self.num_kv_blocks), "--heartbeat-interval-s", str(interval),
                                  *self.prefill_args])
        for i in range(self.num_decode):
            args = ["decode_svc", "--model", str(self.model), "--port", "0", "--pod-id", f"d{i}", "-tp",
                    str(self.decode_tp), "-dcp", str(self.decode_dcp), "--num-kv-blocks", str(self.num_kv_blocks),
                    *self.decode_args]
            if decode_registers:
                args += ["--router", router_addr]
            self._spawn(f"d{i}", args)
        if not decode_registers:
            for i in range(self.num_decode):
                p = self.procs[f"d{i}"]
                p.port = int(self._wait_for(p, r"DecodeWorker on [\d.]+:(\d+)", timeout).group(1))
                reg = _StandInRegistrar(router_addr, self._decode_registration(f"d{i}", p.port), interval,
                                        alive=p.running)
                reg.start()
                self._stand_ins.append(reg)
        self.wait_ready(timeout)
        return self

    def _router_argv(self, port: int) -> list[str]:
        interval = self.heartbeat_interval_s
        return ["router", "--port", str(port), "--model", str(self.model), "--heartbeat-interval-s", str(interval),
                "--eviction-timeout-s", str(max(20 * interval, 5.0)), "--missed-heartbeats-unhealthy", "8",
                *self.router_args]

    def restart_router(self, timeout: float = 120.0) -> None:
        """SIGKILL the router and start a fresh one (empty registry) on the same port; the pods are left alone
        (they must notice and register again by themselves). The old router's log is kept as router-<n>.log."""
        self.kill("router")
        old = self.procs.pop("router")
        old.log.rename(self.workdir / f"router-{sum(1 for _ in self.workdir.glob('router-*.log'))}.log")
        r = self._spawn("router", self._router_argv(self.router_port))
        self._wait_for(r, rf"listening on [\d.]+:{self.router_port}\b", timeout)
        r.port = self.router_port

    def wait_ready(self, timeout: float = 240.0) -> router_pb2.ClusterStatusResponse:
        t0 = time.monotonic()
        want = {f"p{i}" for i in range(self.num_prefill)} | {f"d{i}" for i in range(self.num_decode)}
        md = [("authorization", f"Bearer {self.api_key}")] if self.api_key else None
        with sync_channel(f"127.0.0.1:{self.router_port}", self.client_tls) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            while time.monotonic() - t0 < timeout:
                st = stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=5, metadata=md)
                ready = {p.pod_id for p in st.pods if p.state == common_pb2.POD_STATE_READY}
                if want <= ready:
                    return st
                for proc in self.procs.values():
                    if proc.popen.poll() is not None:
                        raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
                time.sleep(0.1)
        raise TimeoutError(f"pods {sorted(want - ready)} not READY after {timeout}s:\n" +
                           "\n".join(p.tail(15) for p in self.procs.values()))

    def kill(self, name: str) -> None:
        """SIGKILL one process (a pod dying)."""
        p = self.procs[name]
        os.killpg(p.popen.pid, signal.SIGKILL)
        p.popen.wait(timeout=30)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the pods first (they drain and deregister while the router is still up), then the router;
        SIGKILL whatever has not exited after ``grace`` seconds."""
        for reg in self._stand_ins:
            reg.stop()
        pods = [p for n, p in self.procs.items() if n != "router"]
        router = [p for n, p in self.procs.items() if n == "router"]
        for group in (pods, router):
            for p in group:
                if p.popen.poll() is None:
                    try:
                        os.killpg(p.popen.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace
            for p in group:
                try:
                    p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(p.popen.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.popen.wait(timeout=10)

    def logs(self, n: int = 30) -> str:
        return "\n".join(p.tail(n) for p in self.procs.values())

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def router_address(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    # --- stand-in registration (see module docstring) ---
    def _decode_registration(self, pod_id: str, port: int) -> registry_pb2.RegisterWorkerRequest:
        cfg = json.loads((self.model / "config.json").read_text())
        heads, kvh = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        max_len = min(int(cfg.get("max_position_embeddings", 2048)), 8192)
        return registry_pb2.RegisterWorkerRequest(
            pod_id=pod_id, role=common_pb2.ROLE_DECODE, address=f"127.0.0.1:{port}", model=self.model.name,
            model_shape=common_pb2.ModelShape(architecture=cfg["architectures"][0], num_layers=cfg["num_hidden_layers"],
                                              hidden_size=cfg["hidden_size"], num_attention_heads=heads,
                                              num_kv_heads=kvh, head_dim=head_dim, vocab_size=cfg["vocab_size"],
                                              max_model_len=max_len, dtype="float32"),
            parallel=common_pb2.ParallelConfig(tensor_parallel_size=self.decode_tp,
                                               decode_context_parallel_size=self.decode_dcp),
            kv_layout=common_pb2.KVLayout(num_layers=cfg["num_hidden_layers"], block_size=16, num_kv_heads=kvh,
                                          head_dim=head_dim, dtype="float32", tp_size=self.decode_tp,
                                          dcp_size=self.decode_dcp, num_blocks=self.num_kv_blocks),
            capacity=common_pb2.WorkerCapacity(max_model_len=max_len), state=common_pb2.POD_STATE_READY)


class _StandInRegistrar(threading.Thread):
    def __init__(self, router: str, req: registry_pb2.RegisterWorkerRequest, interval: float,
                 alive: Callable[[], bool] = lambda: True) -> None:
        super().__init__(daemon=True)
        self.router, self.req, self.interval, self.alive = router, req, interval, alive
        self._stop = threading.Event()

    def run(self) -> None:
        with grpc.insecure_channel(self.router) as ch:
            stub = registry_pb2_grpc.RegistryStub(ch)
            known = False
            while not self._stop.is_set() and self.alive():  # a dead pod falls silent, like a real one
                try:
                    if not known:
                        r = stub.RegisterWorker(self.req, timeout=5)
                        if not r.accepted:
                            raise RuntimeError(f"router refused stand-in registration of {self.req.pod_id}: "
                                               f"{r.message}")
                        known = True
                    else:
                        known = stub.Heartbeat(registry_pb2.HeartbeatRequest(pod_id=self.req.pod_id),
                                               timeout=5).known
                except grpc.RpcError:
                    pass
                self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
