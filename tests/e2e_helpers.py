"""A real pdserve cluster on loopback for end-to-end tests, as separate processes (``python -m router``,
``python -m prefill_svc``, ``python -m decode_svc``), with what fault tests need beyond LocalCluster: pods named
p0 / d0, SIGKILL of one process and a router restart on the same port."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.security import TLSConfig, sync_channel
from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

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
    client_tls: "TLSConfig | None" = None  # how this harness reaches a router started with --tls-* flags
    api_key: str = ""  # sent to a router started with --api-key
    procs: dict[str, Proc] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    router_port: int = 0

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
        for i in range(self.num_prefill):
            self._spawn(f"p{i}", ["prefill_svc", "--model", str(self.model), "--port", "0", "--pod-id", f"p{i}",
                                  "--router", router_addr, "-tp", str(self.prefill_tp), "--num-kv-blocks",
                                  str(self.num_kv_blocks), "--heartbeat-interval-s", str(interval),
                                  *self.prefill_args])
        for i in range(self.num_decode):
            args = ["decode_svc", "--model", str(self.model), "--port", "0", "--pod-id", f"d{i}", "-tp",
                    str(self.decode_tp), "-dcp", str(self.decode_dcp), "--num-kv-blocks", str(self.num_kv_blocks),
                    "--router", router_addr, *self.decode_args]
            self._spawn(f"d{i}", args)
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
