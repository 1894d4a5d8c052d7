"""LocalCluster: run a router, prefill pods and decode pods as local processes on loopback, and stop them all.

Every service runs in its own session / process group (so the TP-rank processes it spawns share the group and a
signal to the group reaches all of them); stop() sends SIGTERM to each group, waits, then SIGKILLs what is left.
If the supervisor itself dies without stopping them (even by SIGKILL), two things make sure nothing survives it:
- each service's direct process gets PR_SET_PDEATHSIG (SIGKILL when the supervisor goes away; set by
  exec_child.py before it execs the service), and
- a small watchdog process (pdserve.cluster.reaper) holds a pipe from the supervisor; at EOF it kills every group.
Under a restart policy (pdserve.cluster.restart) ``heal()`` restarts services that exited or failed their liveness
probe, with exponential back-off; ``supervise_in_background()`` runs it on a thread.

    cluster = LocalCluster(Topology(model="/path/ckpt").resolve())
    with cluster:                       # start() ... stop()
        print(cluster.endpoints.router)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pdserve.cluster.restart import RestartEvent, RestartPolicy, ServiceHealth
from pdserve.cluster.topology import PodSpec, Topology, router_name

if TYPE_CHECKING:
    from pdserve.security import TLSConfig

log = logging.getLogger("pdserve.cluster")


class ClusterError(RuntimeError):
    """The cluster could not be started (a service exited, or did not become healthy in time)."""


class Interrupted(BaseException):
    """SIGINT / SIGTERM / SIGHUP arrived (raised by the handlers of install_signal_handlers)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Service:
    name: str  # "router", "router-1", "openai-http", "prefill-0", "decode-0", ...
    kind: str  # "router" | "http" | "prefill" | "decode" | "unified"
    argv: list[str]
    address: str  # host:port it serves (gRPC, or HTTP for "http")
    log_path: Path
    spec: PodSpec | None = None
    front_nice: int = 0  # CPU priority of a router / the HTTP front (a pod's is its spec's)
    proc: subprocess.Popen | None = None

    @property
    def nice(self) -> int:
        """The CPU priority exec_child.py gives it (--nice)."""
        return self.spec.nice if self.spec is not None else self.front_nice

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def started_proc(self) -> subprocess.Popen:
        """The process of a service that was started."""
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


@dataclass
class Endpoints:
    router: str  # gRPC host:port of the first router
    http: str | None  # "http://host:port" (https:// under TLS) of the OpenAI-compatible API, or None
    pods: list[dict] = field(default_factory=list)
    log_dir: str = ""
    model: str = ""
    routers: list[str] = field(default_factory=list)  # every router's gRPC host:port, the first one first

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


EXEC_CHILD = str(Path(__file__).with_name("exec_child.py"))
_WHY = {"liveness": " (liveness probe failed)", "startup": " (not serving within the startup timeout)"}


def child_argv(
    argv: list[str],
    parent_pid: int | None,
    cpus: tuple[int, ...] | None = None,
    deathsig: str = "KILL",
    nice: int = 0,
) -> list[str]:
    """argv run through exec_child.py: the child pins itself to ``cpus`` and takes the CPU priority ``nice`` (the pod
    and every rank it spawns inherit both) and, given ``parent_pid``, dies with that parent, then execs argv in the
    same process."""
    opts: list[str] = []
    if cpus is not None:
        opts += ["--cpus", ",".join(map(str, cpus))]
    if nice:
        opts += ["--nice", str(nice)]
    if parent_pid is not None:
        opts += ["--parent", str(parent_pid), "--deathsig", deathsig]
    return [sys.executable, EXEC_CHILD, *opts, "--", *argv]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _tls_values(tls: "TLSConfig | None") -> dict[str, object]:
    """The tls_* config fields that make a service use ``tls`` (nothing for plaintext)."""
    if tls is None:
        return {}
    out: dict[str, object] = {
        f"tls_{f}": getattr(tls, f)
        for f in ("cert_file", "key_file", "ca_file", "server_name")
        if getattr(tls, f) is not None
    }
    return out | ({"tls_require_client_cert": True} if tls.require_client_cert else {})


class LocalCluster:
    """Start / supervise / stop one local cluster. Not thread-safe; call from the main thread (PDEATHSIG is tied to
    the thread that spawned the child)."""

    def __init__(
        self,
        topology: Topology,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        echo: Callable[[str], None] | None = None,
        drain_timeout_s: float = 5.0,
        cluster_token: str = "",
        api_key: str = "",
        tls: TLSConfig | None = None,
        num_routers: int | None = None,
        restart_policy: RestartPolicy | None = None,
    ) -> None:
        if num_routers is not None:  # shorthand for the topology's router count
            if num_routers < 1:
                raise ValueError(f"num_routers must be >= 1, got {num_routers}")
            topology.num_routers = num_routers
        self.topology = topology
        self.tls = tls  # served by every service; also what this supervisor presents when it checks them
        self.api_key = api_key
        self.drain_timeout_s = drain_timeout_s  # told to each service: how long its own SIGTERM drain may take
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on the network
        self.env.setdefault("TOKENIZERS_PARALLELISM", "false")
        # Secrets travel in the environment, not on command lines (visible in ps and in the "starting" lines).
        if cluster_token:
            self.env["PDSERVE_CLUSTER_TOKEN"] = cluster_token
        if api_key:
            self.env["PDSERVE_API_KEY"] = api_key
        # The HTTP front's HTTPS follows --tls-* (passed as --http-tls-* flags); a stray PDSERVE_HTTP_TLS_* in the
        # environment must not make it serve something else than what the health check and the printed URL say.
        from pdserve.security import HTTP_ENV

        for name in HTTP_ENV.values():
            self.env.pop(name, None)
        self.echo = echo or (lambda s: None)
        if log_dir is None:
            from pdserve.default_model import cache_dir

            log_dir = cache_dir() / "logs" / time.strftime(f"up-%Y%m%d-%H%M%S-{os.getpid()}")
        self.log_dir = Path(log_dir)
        self.services: list[Service] = []
        self.endpoints: Endpoints | None = None
        self._reaper: subprocess.Popen | None = None
        self._force = threading.Event()
        self._stopped = False
        self._signalled: int | None = None
        self._raised = False
        self._critical = 0  # > 0 while a child is being spawned: a signal then waits until it is registered
        self.restart_policy = restart_policy or RestartPolicy()
        self.restart_events: list[RestartEvent] = []
        self._health: dict[str, ServiceHealth] = {}
        self._probe_channels: dict[str, object] = {}
        self._lock = threading.RLock()  # heal() (maybe on its own thread) against kill / restart / stop
        self._stopping = threading.Event()
        self._heal_thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------------------------
    # Commands
    # ------------------------------------------------------------------------------------------------------------
    def _plan(self) -> list[Service]:
        # Every argv is built from the services' config classes (pdserve.cli_config): a field renamed there fails
        # here, at planning, instead of as an unknown flag in a child's log.
        from decode_svc.config import DecodeConfig
        from pdserve.cli_config import argv_for
        from prefill_svc.config import PrefillConfig
        from router.config import OpenAIHttpConfig, RouterConfig

        t = self.topology
        h = t.host
        router_addr = ",".join(self.router_addresses)  # the front fails over between them
        py = [self.python, "-m"]
        model = {} if t.model is None else {"model": str(t.model)}
        tls = _tls_values(self.tls)
        services: list[Service] = []

        for i, port in enumerate(t.router_ports):
            name = router_name(i)
            # Routers after the first cannot share its fixed side ports: they take free ones.
            args = t.router_args if i == 0 else _free_side_ports(t.router_args)
            router = [
                *py,
                "router",
                *argv_for(RouterConfig, host=h, port=port, **model, drain_timeout_s=self.drain_timeout_s, **tls),
                *args,
            ]
            log_path = self.log_dir / f"{name}.log"
            services.append(Service(name, "router", router, f"{h}:{port}", log_path, front_nice=t.router_nice or 0))
        if t.http_port is not None:
            # the front is the router's client (no require_client_cert) ...
            front = {k: v for k, v in tls.items() if k != "tls_require_client_cert"}
            serving = self._front_tls()
            if serving is not None:  # ... and serves HTTPS with the same certificate (+ mTLS)
                front |= {f"http_{k}": v for k, v in _tls_values(serving).items() if k != "tls_server_name"}
            services.append(
                Service(
                    "openai-http",
                    "http",
                    [
                        *py,
                        "router.openai_http",
                        *argv_for(OpenAIHttpConfig, router=router_addr, host=h, port=t.http_port, **front),
                    ],
                    f"{h}:{t.http_port}",
                    self.log_dir / "openai-http.log",
                    front_nice=t.router_nice or 0,
                )
            )

        common: dict[str, object] = {
            **model,
            "block_size": t.block_size,
            "host": h,
            "router_address": router_addr,
            "drain_timeout_s": self.drain_timeout_s,
            **tls,
        }
        if not t.local_prefill_auto:  # the profile costs each pod a second or two at start, and only auto reads it
            common["step_profile"] = False
        if t.max_model_len is not None:
            common["max_model_len"] = t.max_model_len
        if t.device is not None:
            common["device"] = t.device
        if t.dtype is not None:
            common["dtype"] = t.dtype
        if t.kv_cache_dtype is not None:
            common["kv_cache_dtype"] = t.kv_cache_dtype
        if t.quantization is not None:
            common["quantization"] = t.quantization
        for p in t.prefill:
            argv = [
                *py,
                "prefill_svc",
                *argv_for(
                    PrefillConfig,
                    common,
                    tensor_parallel_size=p.tensor_parallel_size,
                    port=p.port,
                    pod_id=p.name,
                    **self._pod_common(p),
                ),
            ]
            services.append(
                Service(
                    p.name, "prefill", argv + list(p.extra_args), f"{h}:{p.port}", self.log_dir / f"{p.name}.log", p
                )
            )
        for p in t.decode:
            argv = [
                *py,
                "decode_svc",
                *argv_for(
                    DecodeConfig,
                    common,
                    tensor_parallel_size=p.tensor_parallel_size,
                    decode_context_parallel_size=p.decode_context_parallel_size,
                    dcp_kv_cache_interleave_size=p.dcp_kv_cache_interleave_size,
                    port=p.port,
                    pod_id=p.name,
                    **self._pod_common(p),
                ),
            ]
            services.append(
                Service(p.name, "decode", argv + list(p.extra_args), f"{h}:{p.port}", self.log_dir / f"{p.name}.log", p)
            )
        for p in t.unified:  # a decode pod that also computes prompts: one engine, no KV transfer
            argv = [
                *py,
                "decode_svc",
                *argv_for(
                    DecodeConfig,
                    common,
                    tensor_parallel_size=p.tensor_parallel_size,
                    decode_context_parallel_size=p.decode_context_parallel_size,
                    dcp_kv_cache_interleave_size=p.dcp_kv_cache_interleave_size,
                    port=p.port,
                    pod_id=p.name,
                    unified=True,
                    **self._pod_common(p),
                ),
            ]
            services.append(
                Service(
                    p.name, "unified", argv + list(p.extra_args), f"{h}:{p.port}", self.log_dir / f"{p.name}.log", p
                )
            )
        return services

    @staticmethod
    def _pod_common(p: PodSpec) -> dict[str, object]:
        out: dict[str, object] = {}
        if p.num_kv_blocks is not None:
            out["num_kv_blocks"] = p.num_kv_blocks
        if p.max_num_seqs is not None:
            out["max_num_seqs"] = p.max_num_seqs
        return out

    # ------------------------------------------------------------------------------------------------------------
    # Start
    # ------------------------------------------------------------------------------------------------------------
    def start(self, timeout: float = 600.0) -> Endpoints:
        """Start every service, wait until all are healthy and every pod is READY in the router; return the
        endpoints. On failure everything started is stopped and ClusterError raised (with the failing log's tail).
        """
        t0 = time.monotonic()
        self.topology.assign_ports()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.services = self._plan()
        for line in self.topology.placement():
            self.echo(f"placement {line}")
        try:
            self._start_reaper()
            # Everything is spawned before this process opens any gRPC channel (no threads exist at fork time).
            for s in self.services:
                self._spawn(s)
            self._wait_healthy(self.services, t0 + timeout)
            self._wait_router_http(t0 + timeout)
            self._wait_registered(t0 + timeout)
        except BaseException:
            self.stop()
            raise
        now = time.monotonic()
        pol = self.restart_policy
        self._health = {
            s.name: ServiceHealth(started_at=now, answered=True, next_probe=now + pol.liveness_period_s)
            for s in self.services
        }
        t = self.topology
        self.endpoints = Endpoints(
            router=f"{t.host}:{t.router_port}",
            http=None if t.http_port is None else f"{self.http_scheme}://{t.host}:{t.http_port}",
            pods=[
                {
                    "name": s.name,
                    "role": s.kind,
                    "address": s.address,
                    "pid": s.pid,
                    "tensor_parallel_size": s.spec.tensor_parallel_size,
                    "decode_context_parallel_size": s.spec.decode_context_parallel_size,
                }
                for s in self.services
                if s.spec is not None
            ],
            log_dir=str(self.log_dir),
            model=str(t.model_path()),
            routers=self.router_addresses,
        )
        return self.endpoints

    def _start_reaper(self) -> None:
        self._reaper = subprocess.Popen(
            [self.python, "-m", "pdserve.cluster.reaper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log_dir / "reaper.log", "ab"),
            start_new_session=True,
            env=self.env,
            text=True,
            bufsize=1,
        )

    def _tell_reaper(self, line: str) -> None:
        if self._reaper is not None and self._reaper.stdin is not None:
            try:
                self._reaper.stdin.write(line + "\n")
                self._reaper.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass

    def _threads_per_rank(self, s: Service) -> int:
        """Each pod's ranks share the cores (unless OMP_NUM_THREADS is set): a TP 1 pod gets them all, a pod of more
        ranks than cores one thread per rank. Per pod, not per cluster: a request's prefill and decode run one after
        the other, and a decode pod held to a share of the cores is slower per token for every user (bench
        cluster). The router and the HTTP front compute no tensors: one thread."""
        if s.spec is None:
            return 1
        tp = s.spec.tensor_parallel_size if isinstance(s.spec.tensor_parallel_size, int) else 1
        return max(1, len(s.spec.cpus or os.sched_getaffinity(0)) // tp)  # a pinned pod: the cores it was given

    def _spawn(self, s: Service) -> None:
        self.echo(f"starting {s.name}: {' '.join(s.argv[1:])}")
        env = self.env
        if "OMP_NUM_THREADS" not in env:
            env = {**env, "OMP_NUM_THREADS": str(self._threads_per_rank(s))}
        logf = open(s.log_path, "ab")
        self._critical += 1  # a Ctrl-C now must not leave a started child unrecorded
        try:
            s.proc = subprocess.Popen(
                child_argv(
                    s.argv,
                    # a restart on the healing thread: no death signal, which follows the thread, not the process
                    os.getpid() if threading.current_thread() is threading.main_thread() else None,
                    s.spec.cpus if s.spec is not None else None,
                    nice=s.nice,
                ),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
            self._tell_reaper(str(s.proc.pid))  # its own session: pgid == pid
        finally:
            logf.close()
            self._critical -= 1
        self._raise_pending()

    # ------------------------------------------------------------------------------------------------------------
    # Signals
    # ------------------------------------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM/SIGHUP: the first raises Interrupted in the main thread (deferred while a child is being
        spawned); the next ones make the running stop() SIGKILL at once."""

        def handler(signum: int, frame: object) -> None:
            if self._signalled is not None:
                self.force()
                return
            self._signalled = signum
            self._raise_pending()

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, handler)

    def _raise_pending(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # a restart on the healing thread: the main thread raises at its next spawn or stop
        if self._signalled is not None and self._critical == 0 and not self._raised and not self._stopped:
            self._raised = True
            raise Interrupted(self._signalled)

    def _check_alive(self, services: list[Service] | None = None) -> None:
        for s in self.services if services is None else services:
            rc = s.exited()
            if rc is not None:
                raise ClusterError(
                    f"{s.name} exited with status {rc} while the cluster was starting; "
                    f"last lines of {s.log_path}:\n{s.log_tail()}"
                )

    def _wait_healthy(self, services: list[Service], deadline: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from pdserve.security import sync_channel

        pending = {s.name: s for s in services}
        channels: dict[str, grpc.Channel] = {}
        try:
            while pending:
                self._check_alive(services)
                for name, s in list(pending.items()):
                    if s.kind == "http":
                        if _http_ok(f"{self.http_scheme}://{s.address}/health", self._front_tls()):
                            del pending[name]
                            self.echo(f"{name} is up on {self.http_scheme}://{s.address}")
                        continue
                    ch = channels.get(name) or channels.setdefault(name, sync_channel(s.address, self.tls))
                    try:
                        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                        if r.status == health_pb2.HealthCheckResponse.SERVING:
                            del pending[name]
                            self.echo(f"{name} is serving on {s.address}")
                    except grpc.RpcError:
                        pass
                if pending and time.monotonic() > deadline:
                    raise ClusterError(
                        "timed out waiting for "
                        + ", ".join(pending)
                        + " to serve; last lines of their logs:\n"
                        + "\n".join(f"--- {s.log_path}\n{s.log_tail(15)}" for s in pending.values())
                    )
                if pending:
                    time.sleep(0.25)
        finally:
            for ch in channels.values():
                ch.close()

    @property
    def http_scheme(self) -> str:
        """ "https" when the services serve TLS (the HTTP front then serves HTTPS with the same certificate)."""
        return "https" if self._front_tls() is not None else "http"

    def _front_tls(self) -> "TLSConfig | None":
        return self.tls if self.tls is not None and self.tls.serves_tls else None

    def _wait_router_http(self, deadline: float) -> None:
        """When the router serves the OpenAI HTTP API itself, wait for it too."""
        t = self.topology
        if t.http_port is None or any(s.kind == "http" for s in self.services):
            return
        url = f"http://{t.host}:{t.http_port}/health"
        while not _http_ok(url):
            self._check_alive()
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for the router's HTTP API at {url}")
            time.sleep(0.25)
        self.echo(f"router HTTP API is up on http://{t.host}:{t.http_port}")

    def _wait_registered(self, deadline: float, routers: list[Service] | None = None) -> None:
        """Every pod registered and READY in every router (or in ``routers``), and the model served."""
        for r in routers if routers is not None else [s for s in self.services if s.kind == "router"]:
            self._wait_registered_in(r, deadline)

    def _wait_registered_in(self, router: Service, deadline: float) -> None:
        import grpc

        from pdserve.security import sync_channel
        from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

        want = {s.name for s in self.services if s.spec is not None}
        ch = sync_channel(router.address, self.tls)
        md = [("authorization", f"Bearer {self.api_key}")] if self.api_key else None
        try:
            stub = router_pb2_grpc.RouterStub(ch)
            last = "no answer from the router"
            while True:
                self._check_alive()
                try:
                    st = stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=2.0, metadata=md)
                    ready = {p.pod_id for p in st.pods if p.state == common_pb2.POD_STATE_READY}
                    # a model is ready only where it has both roles; a one-role cluster waits for its pods only
                    if want <= ready and (st.ready_models or not (self.topology.prefill and self.topology.decode)):
                        return
                    states = {p.pod_id: common_pb2.PodState.Name(p.state) for p in st.pods}
                    last = f"pods {states or 'none registered'}, ready models {list(st.ready_models)}"
                except grpc.RpcError as e:
                    last = f"{e.code().name}: {e.details()}"
                if time.monotonic() > deadline:
                    raise ClusterError(f"timed out waiting for every pod to be READY in {router.name} ({last})")
                time.sleep(0.25)
        finally:
            ch.close()

    # ------------------------------------------------------------------------------------------------------------
    # Run / stop
    # ------------------------------------------------------------------------------------------------------------
    def dead_services(self) -> list[Service]:
        """Services that exited and that the restart policy will not start again."""
        out = []
        for s in self.services:
            rc = s.exited()
            if rc is not None and not self.restart_policy.restarts(rc):
                out.append(s)
        return out

    # ------------------------------------------------------------------------------------------------------------
    # Restart policy
    # ------------------------------------------------------------------------------------------------------------
    def heal(self) -> None:
        """Apply the restart policy once: probe the live services, kill one that failed its liveness probe too
        often, and restart each service that exited once its back-off is over. A restarted pod registers with the
        routers by itself, as at start. Cheap when nothing is wrong; a probe waits at most liveness_timeout_s."""
        pol = self.restart_policy
        if not pol.enabled:
            return
        with self._lock:
            for s in self.services:
                if self._stopping.is_set():
                    return
                if s.proc is None:
                    continue
                h = self._health.setdefault(s.name, ServiceHealth(started_at=time.monotonic()))
                now = time.monotonic()
                reason = "exited"
                rc = s.exited()
                if rc is None and h.restart_at is None and now >= h.next_probe:
                    status = self._probe(s, pol.liveness_timeout_s)
                    h.next_probe = time.monotonic() + pol.liveness_period_s
                    if status:
                        h.answered, h.probe_failures = True, 0
                    elif h.answered or status is False:  # NOT_SERVING is an answer: started, then failed
                        h.answered = True
                        h.probe_failures += 1
                        if h.probe_failures >= pol.liveness_failures:
                            self._announce(f"{s.name} failed {h.probe_failures} liveness probes in a row: killing it")
                            self._kill_group(s)
                            rc, reason = s.proc.wait(), "liveness"
                    elif now - h.started_at > pol.startup_timeout_s:
                        self._announce(f"{s.name} is not serving {now - h.started_at:.0f}s after its start: killing it")
                        self._kill_group(s)
                        rc, reason = s.proc.wait(), "startup"
                if rc is None:
                    continue
                if h.restart_at is None:
                    if not pol.restarts(rc):
                        continue
                    if now - h.started_at >= pol.reset_after_s:
                        h.consecutive = 0  # it ran long enough: not a crash loop
                    h.consecutive += 1
                    delay = pol.delay(h.consecutive)
                    h.restart_at, h.exit_code, h.reason, h.delay_s = now + delay, rc, reason, delay
                    self._announce(
                        f"{s.name} exited with status {rc}"
                        f"{_WHY.get(reason, '')}; restarting it in "
                        f"{delay:g}s (restart {h.consecutive} in a row, policy {pol.mode})"
                    )
                if time.monotonic() >= h.restart_at:
                    self._respawn(s, h)

    def _respawn(self, s: Service, h: ServiceHealth) -> None:
        assert s.proc is not None and h.restart_at is not None and h.exit_code is not None
        self._kill_group(s)  # ranks its dead leader left behind
        self._spawn(s)
        now = time.monotonic()
        self.restart_events.append(RestartEvent(s.name, h.exit_code, h.reason, h.delay_s, now, s.proc.pid))
        self._announce(f"restarted {s.name} (pid {s.proc.pid}) after exit status {h.exit_code}")
        h.started_at, h.restart_at, h.exit_code, h.reason = now, None, None, "exited"
        h.answered, h.probe_failures, h.next_probe = False, 0, now + self.restart_policy.liveness_period_s

    def _announce(self, line: str) -> None:
        log.warning("%s", line)
        self.echo(line)

    def _kill_group(self, s: Service) -> None:
        assert s.proc is not None
        try:
            os.killpg(s.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _probe(self, s: Service, timeout: float) -> bool | None:
        """One liveness probe: True when the HTTP front's /health answers 200 or a gRPC service's health says
        SERVING, False when a gRPC service answers NOT_SERVING (it is up, and says it is unhealthy: a pod whose rank
        died), None when nothing answers (still starting, or frozen)."""
        if s.kind == "http":
            return _http_ok(f"{self.http_scheme}://{s.address}/health", self._front_tls()) or None
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from pdserve.security import sync_channel

        ch = self._probe_channels.get(s.name)
        if ch is None:
            ch = self._probe_channels[s.name] = sync_channel(s.address, self.tls)
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:  # no answer, or NOT_FOUND before the server set its health
            return None

    def supervise_in_background(self, period_s: float = 0.2) -> None:
        """Run heal() every ``period_s`` on a daemon thread until stop() (for callers whose main thread is busy,
        such as a benchmark driving load). Services it restarts are still covered by the reaper."""
        if self._heal_thread is not None:
            return

        def loop() -> None:
            while not self._stopping.wait(period_s):
                try:
                    self.heal()
                except Exception:  # keep healing: one failed restart must not end supervision
                    log.exception("applying the restart policy failed")

        self._heal_thread = threading.Thread(target=loop, name="cluster-heal", daemon=True)
        self._heal_thread.start()

    @property
    def router_address(self) -> str:
        """The (first) router's gRPC host:port (known before start(): ports are assigned at planning)."""
        return f"{self.topology.host}:{self.topology.router_port}"

    @property
    def router_addresses(self) -> list[str]:
        """Every router's gRPC host:port, the first one first."""
        return [f"{self.topology.host}:{p}" for p in self.topology.router_ports]

    def service(self, name: str) -> Service:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(f"no service {name!r}; this cluster runs {', '.join(s.name for s in self.services)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one service's whole process group (its ranks included); for SIGKILL, reap it (under a
        restart policy heal() then starts it again)."""
        with self._lock:
            self._kill(name, sig)

    def _kill(self, name: str, sig: int) -> None:
        s = self.service(name)
        assert s.proc is not None, f"{name} was never started"
        try:
            os.killpg(s.proc.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            s.proc.wait(timeout=30)

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """Kill one service if it still runs and start it again with the same command line and port, then wait until
        it serves. Nothing else is touched: a restarted router starts with an empty registry and the pods must
        register again by themselves; a restarted pod registers as it does at start. Its log is appended to."""
        with self._lock:
            s = self.service(name)
            if s.proc is not None and s.proc.poll() is None:
                self._kill(name, signal.SIGKILL)
            self._spawn(s)
            now = time.monotonic()
            self._health[name] = ServiceHealth(started_at=now, next_probe=now + self.restart_policy.liveness_period_s)
        self._wait_healthy([s], time.monotonic() + timeout)

    def log_tails(self, n: int = 30) -> str:
        """The last ``n`` lines of every service's log, each under its name (for failure messages)."""
        return "\n".join(f"--- {s.name} ({s.log_path})\n{s.log_tail(n)}" for s in self.services)

    def force(self) -> None:
        """Make a running stop() skip the remaining grace and SIGKILL at once (a second Ctrl-C)."""
        self._force.set()

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM every group (HTTP front and pods first, then the router), wait up to ``grace`` seconds for each
        phase, SIGKILL what is left, reap. Idempotent."""
        if self._stopped:
            return
        self._stopping.set()
        if self._heal_thread is not None and self._heal_thread is not threading.current_thread():
            self._heal_thread.join(30)
        with self._lock:  # a heal() in progress finishes its restart first; none starts after this
            self._stopped = True
        for ch in self._probe_channels.values():
            ch.close()  # type: ignore[attr-defined]
        self._probe_channels.clear()
        started = [s for s in self.services if s.proc is not None]
        fronts = [s for s in started if s.kind in ("http", "prefill", "decode", "unified")]
        routers = [s for s in started if s.kind == "router"]
        for phase in (fronts, routers):
            self._terminate(phase, grace)
        for s in started:
            try:
                s.started_proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILLed above
                pass
        if self._reaper is not None:
            self._tell_reaper("done")
            try:
                assert self._reaper.stdin is not None  # started with stdin=PIPE
                self._reaper.stdin.close()
            except OSError:
                pass
            try:
                self._reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self._reaper.kill()
            self._reaper = None

    def _terminate(self, services: list[Service], grace: float) -> None:
        """SIGTERM each service's main process (it shuts its own ranks down), wait up to ``grace`` for the whole
        group to go; then SIGKILL every group member left (ranks a dead leader left behind included)."""
        for s in services:
            if s.started_proc.poll() is None:
                self.echo(f"stopping {s.name} (pid {s.started_proc.pid})")
                try:
                    os.kill(s.started_proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace
        leader_gone_at: dict[int, float] = {}
        while time.monotonic() < end and not self._force.is_set():
            now = time.monotonic()
            busy = False
            for s in services:
                if s.started_proc.poll() is not None:  # reaped: the group may disappear now
                    leader_gone_at.setdefault(s.started_proc.pid, now)
                    # a leader that exited gets 1s for its ranks to follow before they are killed
                    if _group_alive(s.started_proc.pid) and now - leader_gone_at[s.started_proc.pid] < 1.0:
                        busy = True
                elif _group_alive(s.started_proc.pid):
                    busy = True
            if not busy:
                break
            time.sleep(0.05)
        for s in services:
            if _group_alive(s.started_proc.pid):
                if s.started_proc.poll() is None:
                    self.echo(f"killing {s.name} (did not stop in {grace:g}s)")
                try:
                    os.killpg(s.started_proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for s in services:
            try:
                s.started_proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        # the group is empty once every member is reaped; wait for that (orphans are reaped by init)
        end = time.monotonic() + 5
        while time.monotonic() < end and any(_group_alive(s.started_proc.pid) for s in services):
            time.sleep(0.02)

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> str:
        """The endpoints as printed by ``pdserve up``."""
        e = self.endpoints
        if e is None:
            return "cluster not started"
        lines = [f"  {router_name(i):<10} grpc  {a}" for i, a in enumerate(e.routers or [e.router])]
        if e.http:
            lines.append(f"  openai     {e.http.split(':', 1)[0]:<5} {e.http}/v1")
        for s in self.services:
            if s.spec is not None:
                lines.append(f"  {s.name:<10} grpc  {s.address:<21} {s.spec.describe():<22} pid {s.pid}")
        lines.append(f"  logs       {e.log_dir}")
        return "\n".join(lines)

    def write_ready_file(self, path: str | os.PathLike[str]) -> None:
        assert self.endpoints is not None
        data = self.endpoints.to_json()
        data["supervisor_pid"] = os.getpid()
        data["pids"] = [s.pid for s in self.services if s.pid is not None]
        data["services"] = [
            {"name": s.name, "kind": s.kind, "address": s.address, "pid": s.pid, "log": str(s.log_path)}
            for s in self.services
        ]
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)


def _free_side_ports(args: list[str]) -> list[str]:
    """``args`` with a fixed --metrics-port replaced by 0 (any free port): a second router cannot bind the same."""
    out = list(args)
    for i, a in enumerate(out):
        if a == "--metrics-port" and i + 1 < len(out):
            out[i + 1] = "0"
        elif a.startswith("--metrics-port="):
            out[i] = "--metrics-port=0"
    return out


def _http_ok(url: str, tls: "TLSConfig | None" = None) -> bool:
    """GET ``url`` answers 200. ``tls``: for https URLs, the CA to trust (else the system roots) and the client
    certificate to present (the supervisor's own, as to the gRPC services under mutual TLS), checking the server's
    name against ``tls.server_name`` when set, else the host dialed."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    if u.hostname is None:  # no host to dial
        return False
    try:
        if u.scheme == "https":
            import ssl

            ctx = tls.ssl_client_context() if tls is not None else ssl.create_default_context()
            name = (tls.server_name if tls is not None else None) or u.hostname

            class _Conn(http.client.HTTPSConnection):
                def connect(self) -> None:
                    http.client.HTTPConnection.connect(self)
                    self.sock = ctx.wrap_socket(self.sock, server_hostname=name)

            conn: http.client.HTTPConnection = _Conn(u.hostname, u.port, timeout=1.0, context=ctx)
        else:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=1.0)
        try:
            conn.request("GET", u.path or "/")
            return conn.getresponse().status == 200
        finally:
            conn.close()
    except Exception:  # not up yet
        return False
