"""The shape of a local cluster: a router plus prefill and decode pods, from ``pdserve up`` flags or a YAML file.

YAML (every key optional; flags given on the command line override the file):

    model: /path/to/checkpoint      # default: the bundled SmolLM2-135M-Instruct
    host: 127.0.0.1
    block_size: 16
    max_model_len: 2048
    device: cpu                     # or cuda; default: the pods' own default
    dtype: bfloat16                 # auto | float32 | bfloat16 | float16, every pod alike; default: auto
    kv_cache_dtype: fp8             # auto | fp8 | fp8_e4m3 | fp8_e5m2, every pod alike; default: auto (= dtype)
    quantization: int8              # none | int8 (W8A8 decoder linears, CPU), every pod alike; default: none
    router: {port: 50051, http_port: 8000}   # http_port: -1 or null = no OpenAI HTTP endpoint, 0 = any free port
    # router: {count: 2, ports: [50051, 50061]}  # N routers; every pod registers with all; ports default to free ones
    # router: {nice: -10}           # CPU priority of the routers and the HTTP front; default: -10 where allowed, else 0
    prefill:
      - {tp: 1, port: 0}                    # port 0 = any free port
    decode:
      - {tp: 2, dcp: 2, interleave: 1}      # tp/dcp "auto": see Topology._auto_dcp
    # cpus: on any pod, the cores it (and its TP ranks) may run on: [0, 1] or "0-3,8"; default: every core
    # nice: on any pod, its CPU priority (-20..19, as nice(1)); default: 0
    # unified: [{cpus: "0-1"}]            # colocated pods that prefill and decode their own requests (no P/D)
    # a role may also be a count plus shared settings:  prefill: {count: 2, tp: 1}

The whole topology is checked once, with pdserve.parallel_config (the rules the pods themselves apply), before any
process starts: DCP on a prefill pod, a TP/DCP pair the model does not allow, clashing ports are refused with the
rule's message and the suggested fix.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from pdserve.engine.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS
from pdserve.net import free_port
from pdserve.parallel_config import ModelParallelInfo, ParallelConfig, check_parallel_config
from pdserve.sched import NICE_RANGE, may_set_nice

AUTO = "auto"
DEFAULT_ROUTER_PORT = 50051
DEFAULT_HTTP_PORT = 8000
MAX_AUTO_TP = 16  # "auto" never picks more TP ranks than this
# The front doors' default priority: their work per request is small and on every request's path, a pod's is bulk
# compute (docs/performance.md, "A router's threads and the Linux scheduler").
FRONT_NICE = -10


class TopologyError(ValueError):
    """The topology cannot run; the message names the pod, the rule, and the fix."""


@dataclass
class PodSpec:
    role: str  # "prefill" | "decode" | "unified"
    tensor_parallel_size: int | str = 1  # or "auto" (decode)
    decode_context_parallel_size: int | str = 1  # or "auto" (decode)
    dcp_kv_cache_interleave_size: int = 1
    port: int = 0  # 0: any free port
    num_kv_blocks: int | None = None  # per rank; None: the pod's default
    max_num_seqs: int | None = None
    extra_args: list[str] = field(default_factory=list)  # passed verbatim to the pod's command line
    cpus: tuple[int, ...] | None = None  # cores of the pod and its ranks (sched_setaffinity); None: every core
    nice: int = 0  # CPU priority of the pod and its ranks (process and session nice)
    name: str = ""  # "prefill-0", "decode-1", ... (assigned by Topology)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=int(self.tensor_parallel_size),
            decode_context_parallel_size=int(self.decode_context_parallel_size),
            dcp_kv_cache_interleave_size=self.dcp_kv_cache_interleave_size,
        )

    def describe(self) -> str:
        s = f"tp={self.tensor_parallel_size}"
        if self.role != "prefill":
            s += f" dcp={self.decode_context_parallel_size}"
            if self.dcp_kv_cache_interleave_size != 1:
                s += f" interleave={self.dcp_kv_cache_interleave_size}"
        if self.cpus is not None:
            s += f" cpus={format_cpus(self.cpus)}"
        if self.nice:
            s += f" nice={self.nice}"
        return s


def parse_cpus(v: Any, what: str = "cpus") -> tuple[int, ...]:
    """A core list as taskset / cpuset write it ("0-3,8") or a list of ints, sorted and without repeats."""
    out: set[int] = set()
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v]
    if isinstance(v, str):
        try:
            for part in v.replace(" ", "").split(","):
                lo, sep, hi = part.partition("-")
                out.update(range(int(lo), int(hi) + 1) if sep else [int(lo)])
        except ValueError:
            raise TopologyError(f'{what}: expected cores like "0-3,8" or [0, 1], got {v!r}') from None
    elif isinstance(v, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool) for c in v):
        out.update(v)
    else:
        raise TopologyError(f'{what}: expected cores like "0-3,8" or [0, 1], got {v!r}')
    if not out or min(out) < 0:
        raise TopologyError(f"{what}: expected at least one core number >= 0, got {v!r}")
    return tuple(sorted(out))


def format_cpus(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5" (the cpuset syntax of docker compose and taskset -c)."""
    parts: list[str] = []
    for c in cpus:
        if parts and c == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{c}"
        else:
            parts.append(str(c))
    return ",".join(parts)


def default_prefill() -> PodSpec:
    return PodSpec(role="prefill")


def default_decode() -> PodSpec:
    return PodSpec(role="decode", tensor_parallel_size=AUTO, decode_context_parallel_size=AUTO)


def default_unified() -> PodSpec:
    return PodSpec(role="unified")


@dataclass
class Topology:
    model: str | None = None  # checkpoint directory; None: the default model
    host: str = "127.0.0.1"
    router_port: int = DEFAULT_ROUTER_PORT  # 0: any free port
    http_port: int | None = DEFAULT_HTTP_PORT  # None: no OpenAI HTTP endpoint; 0: any free port
    block_size: int = 16
    max_model_len: int | None = None
    device: str | None = None  # "cpu", "cuda", ...; None: the pods' default
    dtype: str | None = None  # EngineConfig.dtype of every pod (a prefill and a decode pod must agree); None: auto
    kv_cache_dtype: str | None = None  # EngineConfig.kv_cache_dtype of every pod (they must agree); None: auto
    quantization: str | None = None  # EngineConfig.quantization of every pod; None: none
    prefill: list[PodSpec] = field(default_factory=lambda: [default_prefill()])
    decode: list[PodSpec] = field(default_factory=lambda: [default_decode()])
    unified: list[PodSpec] = field(default_factory=list)  # colocated pods (a decode_svc started with --unified)
    router_args: list[str] = field(default_factory=list)
    num_routers: int = 1  # every pod registers with all of them; the first is router_port
    extra_router_ports: list[int] = field(default_factory=list)  # routers 2..N (0 or missing: any free port)
    router_nice: int | None = None  # CPU priority of the routers and the HTTP front; None: FRONT_NICE where allowed
    warnings: list[str] = field(default_factory=list)  # set by resolve()
    notes: list[str] = field(default_factory=list)  # set by resolve(): what "auto" chose and why

    @property
    def pods(self) -> list[PodSpec]:
        return [*self.prefill, *self.decode, *self.unified]

    @property
    def local_prefill_auto(self) -> bool:
        """Whether router.args set --local-prefill-max-tokens auto (the routers then read the pods' step profiles), as
        the router reads the value (router/local_prefill.py)."""
        from router.local_prefill import AUTO, FLAG, parse_max_tokens

        args = self.router_args
        values = [b for a, b in zip(args, args[1:]) if a == FLAG] + [
            a[len(FLAG) + 1 :] for a in args if a.startswith(FLAG + "=")
        ]
        try:
            return any(parse_max_tokens(v) == AUTO for v in values)
        except ValueError:  # the router refuses it at start, naming the flag
            return False

    @property
    def router_ports(self) -> list[int]:
        """Every router's gRPC port, the first router's first."""
        extra = list(self.extra_router_ports[: self.num_routers - 1])
        return [self.router_port, *extra, *[0] * (self.num_routers - 1 - len(extra))]

    # ------------------------------------------------------------------------------------------------------------
    # Loading
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> "Topology":
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise TopologyError(f"cannot read topology file {path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise TopologyError(f"{path}: not valid YAML: {e}") from None
        try:
            return cls.from_dict(data or {})
        except TopologyError as e:
            raise TopologyError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, data: Any) -> "Topology":
        if not isinstance(data, Mapping):
            raise TopologyError(f"the topology must be a mapping, got {type(data).__name__}")
        known = {
            "model",
            "host",
            "block_size",
            "max_model_len",
            "device",
            "dtype",
            "kv_cache_dtype",
            "quantization",
            "router",
            "prefill",
            "decode",
            "unified",
        }
        _no_unknown(data, known, "topology")
        topo = cls()
        if data.get("model") is not None:
            topo.model = str(data["model"])
        if "host" in data:
            topo.host = _str(data["host"], "host")
        if "block_size" in data:
            topo.block_size = _int(data["block_size"], "block_size", lo=1)
        if data.get("max_model_len") is not None:
            topo.max_model_len = _int(data["max_model_len"], "max_model_len", lo=2)
        if data.get("device") is not None:
            topo.device = _str(data["device"], "device")
        if data.get("dtype") is not None:
            topo.dtype = _str(data["dtype"], "dtype")
            if topo.dtype not in DTYPES:
                raise TopologyError(f"dtype must be one of {', '.join(DTYPES)}, got {topo.dtype!r}")
        if data.get("kv_cache_dtype") is not None:
            topo.kv_cache_dtype = _str(data["kv_cache_dtype"], "kv_cache_dtype")
            if topo.kv_cache_dtype not in KV_CACHE_DTYPES:
                raise TopologyError(
                    f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {topo.kv_cache_dtype!r}"
                )
        if data.get("quantization") is not None:
            topo.quantization = _str(data["quantization"], "quantization")
            if topo.quantization not in QUANTIZATIONS:
                raise TopologyError(
                    f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {topo.quantization!r}"
                )
        router = data.get("router") or {}
        if not isinstance(router, Mapping):
            raise TopologyError("router: expected a mapping like {port: 50051, http_port: 8000}")
        _no_unknown(router, {"port", "http_port", "args", "count", "ports", "nice"}, "router")
        if "port" in router:
            topo.router_port = _port(router["port"], "router.port")
        if "count" in router:
            topo.num_routers = _int(router["count"], "router.count", lo=1)
        if "ports" in router:
            ports = router["ports"]
            if not isinstance(ports, list) or not ports:
                raise TopologyError("router.ports: expected a list of ports, one per router")
            ports = [_port(v, f"router.ports[{i}]") for i, v in enumerate(ports)]
            if "count" in router and len(ports) != topo.num_routers:
                raise TopologyError(f"router.ports lists {len(ports)} ports but router.count is {topo.num_routers}")
            if "port" in router and ports[0] != topo.router_port:
                raise TopologyError("router.port and router.ports[0] differ: give one of them")
            topo.num_routers = len(ports)
            topo.router_port, topo.extra_router_ports = ports[0], ports[1:]
        if "http_port" in router:
            hp = router["http_port"]
            topo.http_port = None if hp is None or hp == -1 or hp is False else _port(hp, "router.http_port")
        if "args" in router:
            topo.router_args = _args(router["args"], "router.args")
        if router.get("nice") is not None:
            topo.router_nice = _nice(router["nice"], "router.nice")
        for role in ("prefill", "decode", "unified"):
            if role in data:
                setattr(topo, role, _pods(role, data[role]))
        if data.get("unified") and "prefill" not in data and "decode" not in data:
            topo.prefill, topo.decode = [], []  # unified pods alone serve; no default P/D pair beside them
        return topo

    def with_overrides(self, **kw: Any) -> "Topology":
        """A copy with the given (non-None) top-level fields and per-role pod settings replaced:
        ``prefill_pods``/``decode_pods`` (counts), ``prefill_tp``, ``decode_tp``, ``decode_dcp``,
        ``dcp_interleave``, ``num_kv_blocks``."""
        t = dataclasses.replace(
            self,
            prefill=[dataclasses.replace(p) for p in self.prefill],
            decode=[dataclasses.replace(p) for p in self.decode],
            unified=[dataclasses.replace(p) for p in self.unified],
            warnings=[],
            extra_router_ports=list(self.extra_router_ports),
        )
        if kw.get("num_routers") is not None:
            if kw["num_routers"] < 1:
                raise TopologyError(f"--routers must be >= 1, got {kw['num_routers']}")
            t.num_routers = kw["num_routers"]
        for name in (
            "model",
            "host",
            "router_port",
            "block_size",
            "max_model_len",
            "device",
            "dtype",
            "kv_cache_dtype",
            "quantization",
        ):
            if kw.get(name) is not None:
                setattr(t, name, kw[name])
        if kw.get("router_nice") is not None:
            t.router_nice = _nice(kw["router_nice"], "--router-nice")
        if "http_port" in kw and kw["http_port"] is not None:
            t.http_port = None if kw["http_port"] < 0 else kw["http_port"]
        if kw.get("unified"):  # `pdserve up --unified`: colocated pods instead of the P/D pair
            t.prefill, t.decode = [], []
            t.unified = t.unified or [default_unified()]
        for role in ("prefill", "decode"):
            n = kw.get(f"{role}_pods")
            if kw.get("unified") and n is None:
                continue
            pods = getattr(t, role)
            if n is not None:
                if n < 1:
                    raise TopologyError(f"--{role}-pods must be >= 1, got {n}")
                template = pods[0] if pods else (default_prefill() if role == "prefill" else default_decode())
                pods = [pods[i] if i < len(pods) else dataclasses.replace(template, port=0, name="") for i in range(n)]
            setattr(t, role, pods)
        for p in t.prefill:
            if kw.get("prefill_tp") is not None:
                p.tensor_parallel_size = kw["prefill_tp"]
        for p in t.decode:
            if kw.get("decode_tp") is not None:
                p.tensor_parallel_size = kw["decode_tp"]
            if kw.get("decode_dcp") is not None:
                p.decode_context_parallel_size = kw["decode_dcp"]
            if kw.get("dcp_interleave") is not None:
                p.dcp_kv_cache_interleave_size = kw["dcp_interleave"]
        if kw.get("num_kv_blocks") is not None:
            for p in t.pods:
                p.num_kv_blocks = kw["num_kv_blocks"]
        for role in ("prefill", "decode", "unified"):
            if kw.get(f"{role}_cpus") is not None:
                cpus = parse_cpus(kw[f"{role}_cpus"], f"--{role}-cpus")
                for p in getattr(t, role, []):
                    p.cpus = cpus
        return t

    # ------------------------------------------------------------------------------------------------------------
    # Validation
    # ------------------------------------------------------------------------------------------------------------
    def model_path(self) -> Path:
        if self.model is not None:
            return Path(self.model)
        from pdserve.default_model import ensure_default_model

        return ensure_default_model()

    def resolve(
        self, model: ModelParallelInfo | None = None, cores: int | None = None, one_role: bool = False
    ) -> "Topology":
        """Check everything once and fill in "auto" sizes and pod names; returns self. Raises TopologyError.
        cores: CPU cores the pods share (default: this process's CPU affinity). one_role: allow a cluster without
        decode (or without prefill) pods, which cannot generate but serves one role (e.g. prefill-only tests)."""
        if not self.prefill and not (one_role and self.decode) and not self.unified:
            raise TopologyError("the cluster needs at least one prefill pod (or unified pods)")
        if not self.decode and not (one_role and self.prefill) and not self.unified:
            raise TopologyError("the cluster needs at least one decode pod (or unified pods)")
        if self.unified and bool(self.prefill) != bool(self.decode):
            raise TopologyError(
                "unified pods serve alone or beside a prefill/decode pair (where they act as decode "
                "targets): give both prefill and decode pods, or neither"
            )
        if self.model is not None:
            mp = Path(self.model)
            if mp.suffix == ".gguf":  # config and tokenizer come from the file's metadata
                if not mp.is_file():
                    raise TopologyError(f"--model {self.model}: no such GGUF file")
            elif not (mp / "config.json").is_file():
                raise TopologyError(f"--model {self.model}: not a checkpoint directory (no config.json)")
            elif not (mp / "tokenizer.json").is_file():
                raise TopologyError(f"--model {self.model}: the router needs tokenizer.json next to config.json")
        if model is None:
            try:
                model = ModelParallelInfo.from_model_path(self.model_path())
            except (OSError, ValueError) as e:
                raise TopologyError(f"cannot read the model's config: {e}") from None
        self.warnings, self.notes = [], []
        self._cores = cores if cores is not None else len(os.sched_getaffinity(0))
        for role in ("prefill", "decode", "unified"):
            for i, p in enumerate(getattr(self, role)):
                p.role = role
                p.name = p.name or f"{role}-{i}"
                self._resolve_pod(p, model)
        self._check_ports()
        self._check_cpus()
        self._check_nice()
        return self

    def _check_nice(self) -> None:
        """A priority above the default (nice < 0) needs CAP_SYS_NICE: refused here when asked for, and the routers'
        default falls back to 0 (said in the notes) where this process may not raise it."""
        asked = [(f"{p.name}: nice", p.nice) for p in self.pods]
        if self.router_nice is not None:
            asked.append(("router.nice", self.router_nice))
        for what, nice in asked:
            if not may_set_nice(nice):
                raise TopologyError(
                    f"{what} {nice} raises a CPU priority, which needs CAP_SYS_NICE (or root): grant it, or leave "
                    "the routers at 0 and give the pods a lower priority instead (nice: 5 on each pod)"
                )
        if self.router_nice is None:
            if may_set_nice(FRONT_NICE):
                self.router_nice = FRONT_NICE
            else:
                self.router_nice = 0
                self.notes.append(
                    f"routers at nice 0: their default CPU priority (nice {FRONT_NICE}) needs CAP_SYS_NICE; under "
                    "load the pods may delay them (give the pods nice: 5 in a topology file)"
                )

    def _check_cpus(self) -> None:
        """Every pinned pod's cores must be ones this process may use (sched_setaffinity would fail in the child)."""
        allowed = os.sched_getaffinity(0)
        for p in self.pods:
            if p.cpus is not None and not set(p.cpus) <= allowed:
                raise TopologyError(
                    f"{p.name}: cpus {format_cpus(p.cpus)} include cores this machine does not offer "
                    f"(available: {format_cpus(tuple(sorted(allowed)))}); pick cores from those"
                )

    def placement(self) -> list[str]:
        """One line per pod, and one for the front doors: where they run and at which CPU priority (what `pdserve up`
        logs before starting anything)."""
        every = format_cpus(tuple(sorted(os.sched_getaffinity(0))))
        fronts = "routers" if self.num_routers > 1 else "router"
        return [
            f"{fronts}{' and the HTTP front' if self.http_port is not None else ''}: nice {self.router_nice or 0}",
            *(
                f"{p.name}: cpus {format_cpus(p.cpus) if p.cpus is not None else every + ' (unpinned)'}, "
                f"{max(1, len(p.cpus or os.sched_getaffinity(0)) // int(p.tensor_parallel_size))} thread(s) "
                f"per rank x {p.tensor_parallel_size} rank(s), nice {p.nice}"
                for p in self.pods
            ),
        ]

    def _resolve_pod(self, p: PodSpec, model: ModelParallelInfo) -> None:
        tp, dcp = p.tensor_parallel_size, p.decode_context_parallel_size
        if p.role == "unified":  # "auto" picks no DCP: the pod computes whole prompts on its own ranks
            p.tensor_parallel_size = tp = 1 if tp == AUTO else tp
            p.decode_context_parallel_size = dcp = 1 if dcp == AUTO else dcp
        if p.role == "prefill":
            if tp == AUTO:
                tp = p.tensor_parallel_size = 1
            if dcp == AUTO:
                dcp = p.decode_context_parallel_size = 1
            if dcp != 1:
                raise TopologyError(
                    f"{p.name}: decode context parallelism is decode-only; "
                    f"a prefill pod needs dcp=1 (got {dcp}). Suggested fix: remove dcp from the "
                    "prefill pods"
                )
        if tp == AUTO or dcp == AUTO:
            tp, dcp = self._auto_dcp(p, model, tp, dcp)
            p.tensor_parallel_size, p.decode_context_parallel_size = tp, dcp
        for name, v in (("tp", tp), ("dcp", dcp), ("interleave", p.dcp_kv_cache_interleave_size)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TopologyError(f"{p.name}: {name} must be a positive integer or 'auto', got {v!r}")
        assert isinstance(tp, int) and isinstance(dcp, int)  # checked just above
        cfg = ParallelConfig(
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            dcp_kv_cache_interleave_size=p.dcp_kv_cache_interleave_size,
            block_size=self.block_size,
        )
        verdict = check_parallel_config(model, cfg)
        if not verdict.valid:
            fix = f" Suggested fix for {p.name}: {verdict.fix.text}" if verdict.fix is not None else ""
            raise TopologyError(f"{p.name} ({p.describe()}): {verdict.message}{fix}")

    def _auto_dcp(self, p: PodSpec, model: ModelParallelInfo, tp: int | str, dcp: int | str) -> tuple[int, int]:
        """The smallest TP (then the smallest DCP > 1) that the model allows, honouring whichever is fixed. With both
        left to auto on CPU, DCP only where its ranks get a core each: more ranks than cores decode slower than one
        rank using every core (pdserve bench decode), so the pod then runs TP 1 and says how to ask for DCP."""
        tps = [tp] if tp != AUTO else [t for t in range(1, MAX_AUTO_TP + 1)]
        dcps = [dcp] if dcp != AUTO else list(range(2, MAX_AUTO_TP + 1))
        for t in tps:
            for d in dcps:
                if not isinstance(t, int) or not isinstance(d, int) or d > t:
                    continue
                cfg = ParallelConfig(
                    tensor_parallel_size=t,
                    decode_context_parallel_size=d,
                    dcp_kv_cache_interleave_size=p.dcp_kv_cache_interleave_size,
                    block_size=self.block_size,
                )
                if check_parallel_config(model, cfg).valid:
                    return self._fit_cores(p, model, tp, dcp, t, d)
        # No DCP > 1 layout exists for this model (e.g. MHA): run without DCP and say so.
        t = 1 if tp == AUTO else tp
        if dcp != AUTO:
            raise TopologyError(
                f"{p.name}: no tensor-parallel size up to {MAX_AUTO_TP} allows dcp={dcp} for this "
                f"model ({model.kind}, {model.num_attention_heads} heads, {model.num_kv_heads} KV "
                "heads); choose another dcp or tp"
            )
        self.warnings.append(
            f"{p.name}: this model ({model.kind}, {model.num_attention_heads} heads, "
            f"{model.num_kv_heads} KV heads) allows no DCP > 1"
            + (f" at tp={tp}" if tp != AUTO else "")
            + f"; running {p.name} with tp={t} dcp=1"
        )
        return int(t), 1

    def _fit_cores(
        self, p: PodSpec, model: ModelParallelInfo, tp: int | str, dcp: int | str, t: int, d: int
    ) -> tuple[int, int]:
        shape = f"{model.num_attention_heads} heads, {model.num_kv_heads} KV heads"
        on_gpu = (self.device or "cpu").startswith("cuda")
        if on_gpu or tp != AUTO or dcp != AUTO or t <= self._cores:
            if tp == AUTO and dcp == AUTO:
                where = "GPUs" if on_gpu else f"{self._cores} cores"
                self.notes.append(
                    f"{p.name}: tp={t} dcp={d}, the smallest DCP layout this model allows ({shape}); "
                    f"{t} ranks on {where}"
                )
            return t, d
        self.notes.append(
            f"{p.name}: tp=1 dcp=1: DCP for this model ({shape}) needs tp={t}, more ranks than this "
            f"machine's {self._cores} cores, and ranks sharing cores decode slower than one rank on "
            f"all of them; for DCP anyway pass --decode-tp {t} --decode-dcp {d}"
        )
        return 1, 1

    def _check_ports(self) -> None:
        seen: dict[int, str] = {}
        named = [(router_name(i), port) for i, port in enumerate(self.router_ports)]
        if self.http_port is not None:
            named.append(("router http", self.http_port))
        named += [(p.name, p.port) for p in self.pods]
        for who, port in named:
            if port == 0:
                continue
            if port in seen:
                raise TopologyError(f"port {port} is given to both {seen[port]} and {who}")
            seen[port] = who

    def assign_ports(self) -> None:
        """Replace every port 0 by a free port of this host (so the endpoints are known before anything starts),
        clear of the ports the services' own arguments name (``--metrics-port 9100``): those bind only later."""
        taken: set[int] = {p for p in [*self.router_ports, self.http_port or 0, *[q.port for q in self.pods]] if p}
        for args in [self.router_args, *[q.extra_args for q in self.pods]]:
            taken |= _ports_in_args(args)
        ports = self.router_ports
        for i, port in enumerate(ports):
            if port == 0:
                ports[i] = free_port(self.host, taken)
                taken.add(ports[i])
        self.router_port, self.extra_router_ports = ports[0], ports[1:]
        if self.http_port == 0:
            self.http_port = free_port(self.host, taken)
            taken.add(self.http_port)
        for p in self.pods:
            if p.port == 0:
                p.port = free_port(self.host, taken)
                taken.add(p.port)


def _ports_in_args(args: list[str]) -> set[int]:
    """The port numbers a service's command line names: the value after (or in) any ``--...-port`` flag."""
    ports: set[int] = set()
    for i, a in enumerate(args):
        flag, eq, val = a.partition("=")
        if not (flag.startswith("--") and flag.endswith("-port")):
            continue
        val = val if eq else (args[i + 1] if i + 1 < len(args) else "")
        if val.isdigit() and int(val) > 0:
            ports.add(int(val))
    return ports


def router_name(i: int) -> str:
    """The service name of router ``i`` (0-based): "router", "router-1", ..."""
    return "router" if i == 0 else f"router-{i}"


# ----------------------------------------------------------------------------------------------------------------
# YAML helpers
# ----------------------------------------------------------------------------------------------------------------

_POD_KEYS = {
    "tp": "tensor_parallel_size",
    "tensor_parallel_size": "tensor_parallel_size",
    "dcp": "decode_context_parallel_size",
    "decode_context_parallel_size": "decode_context_parallel_size",
    "interleave": "dcp_kv_cache_interleave_size",
    "dcp_kv_cache_interleave_size": "dcp_kv_cache_interleave_size",
    "port": "port",
    "num_kv_blocks": "num_kv_blocks",
    "max_num_seqs": "max_num_seqs",
    "args": "extra_args",
    "name": "name",
    "cpus": "cpus",
    "nice": "nice",
}


def _pods(role: str, value: Any) -> list[PodSpec]:
    if isinstance(value, Mapping):  # {count: N, tp: ..., ...}
        spec = dict(value)
        count = _int(spec.pop("count", 1), f"{role}.count", lo=1)
        if "port" in spec and spec["port"] and count > 1:
            raise TopologyError(f"{role}: a fixed port cannot be shared by {count} pods; list the pods instead")
        return [_pod(role, i, spec) for i in range(count)]
    if isinstance(value, int) and not isinstance(value, bool):
        return [_pod(role, i, {}) for i in range(_int(value, role, lo=1))]
    if not isinstance(value, list) or not value:
        raise TopologyError(f"{role}: expected a non-empty list of pods, a count, or {{count: N, ...}}")
    return [_pod(role, i, v) for i, v in enumerate(value)]


def _pod(role: str, i: int, spec: Any) -> PodSpec:
    where = f"{role}[{i}]"
    if spec is None:
        spec = {}
    if not isinstance(spec, Mapping):
        raise TopologyError(f"{where}: expected a mapping like {{tp: 2, dcp: 2}}, got {spec!r}")
    _no_unknown(spec, set(_POD_KEYS), where)
    pod = default_prefill() if role == "prefill" else default_decode()
    for key, value in spec.items():
        attr = _POD_KEYS[key]
        if attr in ("tensor_parallel_size", "decode_context_parallel_size"):
            value = AUTO if value == AUTO else _int(value, f"{where}.{key}", lo=1)
        elif attr == "dcp_kv_cache_interleave_size":
            value = _int(value, f"{where}.{key}", lo=1)
        elif attr == "port":
            value = _port(value, f"{where}.port")
        elif attr in ("num_kv_blocks", "max_num_seqs"):
            value = None if value is None else _int(value, f"{where}.{key}", lo=1)
        elif attr == "extra_args":
            value = _args(value, f"{where}.args")
        elif attr == "name":
            value = _str(value, f"{where}.name")
        elif attr == "cpus":
            value = None if value is None else parse_cpus(value, f"{where}.cpus")
        elif attr == "nice":
            value = 0 if value is None else _nice(value, f"{where}.nice")
        setattr(pod, attr, value)
    return pod


def _no_unknown(d: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = [k for k in d if k not in known]
    if unknown:
        raise TopologyError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}"
        )


def _int(v: Any, what: str, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TopologyError(f"{what} must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise TopologyError(f"{what} must be >= {lo}, got {v}")
    return v


def _nice(v: Any, what: str) -> int:
    v = _int(v, what)
    if v not in NICE_RANGE:
        raise TopologyError(f"{what} must be a nice value in [-20, 19] (lower runs first), got {v}")
    return v


def _port(v: Any, what: str) -> int:
    v = _int(v, what)
    if not 0 <= v <= 65535:
        raise TopologyError(f"{what} must be a port number in [0, 65535] (0 = any free port), got {v}")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise TopologyError(f"{what} must be a non-empty string, got {v!r}")
    return v


def _args(v: Any, what: str) -> list[str]:
    if isinstance(v, str):
        import shlex

        return shlex.split(v)
    if not isinstance(v, list) or not all(isinstance(a, (str, int, float)) for a in v):
        raise TopologyError(f"{what} must be a list of command-line arguments")
    return [str(a) for a in v]
