"""The end-to-end tests' cluster: pdserve's own LocalCluster (pdserve.cluster), shaped as the tests need it — pods
named p0 / d0, fast heartbeats, one thread per process, the checkout on PYTHONPATH. Fault tests use the
supervisor's per-service controls (``kill``, ``restart``, ``service(name).pid``)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

from pdserve.cluster.supervisor import LocalCluster
from pdserve.cluster.topology import PodSpec, Topology

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 0.25  # the pods' and the router's heartbeat interval in these clusters


def supports_flag(module: str, flag: str) -> bool:
    """Whether ``python -m module`` takes ``flag``: asked of its config class (pdserve.cli_config)."""
    from decode_svc.config import DecodeConfig
    from pdserve.cli_config import flags_of
    from prefill_svc.config import PrefillConfig
    from router.config import RouterConfig

    classes: dict[str, type] = {"decode_svc": DecodeConfig, "prefill_svc": PrefillConfig, "router": RouterConfig}
    return flag in flags_of(classes[module])


def service_env() -> dict[str, str]:
    """The environment of every process a test starts: this checkout first on the path, offline, one thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 shared cores: one thread per process
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# Tests check every KV hand-off against the prefill pod's block checksums (off by default in production for its cost).
KV_CHECKSUMS = ["--kv-checksum"]


def e2e_cluster(
    workdir: Path,
    model: Path,
    *,
    num_prefill: int = 2,
    num_decode: int = 2,
    prefill_tp: int = 1,
    decode_tp: int = 2,
    decode_dcp: int = 2,
    num_kv_blocks: int = 256,
    router_args: list[str] | None = None,
    prefill_args: list[str] | None = None,
    decode_args: list[str] | None = None,
    http: bool = False,
    **supervisor: Any,
) -> LocalCluster:
    """A LocalCluster (not started) of a router, prefill pods p0.. and decode pods d0.. on loopback, every port free
    at planning; the OpenAI HTTP front only with ``http`` (its URL: ``start().http``); prefill pods send KV block
    checksums. ``supervisor``: LocalCluster's keywords (tls, api_key, cluster_token, ...)."""
    interval = ["--heartbeat-interval-s", str(HEARTBEAT_S)]
    router = [
        *interval,
        "--eviction-timeout-s",
        str(max(20 * HEARTBEAT_S, 5.0)),
        "--missed-heartbeats-unhealthy",
        "8",
        *(router_args or []),
    ]
    topo = Topology(
        model=str(model),
        router_port=0,
        http_port=0 if http else None,
        router_args=router,
        prefill=[
            PodSpec(
                "prefill",
                prefill_tp,
                num_kv_blocks=num_kv_blocks,
                name=f"p{i}",
                extra_args=[*interval, *KV_CHECKSUMS, *(prefill_args or [])],
            )
            for i in range(num_prefill)
        ],
        decode=[
            PodSpec(
                "decode",
                decode_tp,
                decode_dcp,
                num_kv_blocks=num_kv_blocks,
                name=f"d{i}",
                extra_args=list(decode_args or []),
            )
            for i in range(num_decode)
        ],
    )
    topo.resolve(one_role=True)
    workdir.mkdir(parents=True, exist_ok=True)
    return LocalCluster(topo, log_dir=workdir, env=service_env(), **supervisor)


def wait_for_log(proc: subprocess.Popen, log: Path, pattern: str, timeout: float) -> re.Match:
    """Wait until ``log`` (written by ``proc``) matches ``pattern``; fail with its tail if ``proc`` exits first."""
    rx = re.compile(pattern)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = rx.search(log.read_text(errors="replace"))
        if m:
            return m
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before printing {pattern!r}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{pattern!r} not in {log} within {timeout}s:\n{log.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def metered_http_cluster(workdir: Path, model: Path, ports: dict[str, int], num_kv_blocks: int) -> Iterator[Any]:
    """A started cluster of one prefill pod and one TP 1 decode pod behind the router and the OpenAI front, the pods
    serving /metrics on ``ports["prefill"]`` / ``ports["decode"]``; yields its endpoints and stops it after."""
    c = e2e_cluster(
        workdir,
        model,
        num_prefill=1,
        num_decode=1,
        decode_tp=1,
        decode_dcp=1,
        num_kv_blocks=num_kv_blocks,
        http=True,
        prefill_args=["--metrics-port", str(ports["prefill"])],
        decode_args=["--metrics-port", str(ports["decode"])],
    )
    endpoints = c.start()
    try:
        yield endpoints
    finally:
        c.stop()
