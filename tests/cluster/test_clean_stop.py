"""A clean stop for every role: SIGTERM to an idle or a busy prefill pod, decode pod and router ends the process
with code 0 within its drain timeout + 2 s, with its whole process group (TP rank processes, NIXL / UCX and
kv_transfer threads) gone; nothing has to be SIGKILLed. Busy means: a prefill pod holding a KV lease that no decode
pod ever reads, a decode pod streaming a long request, a router with that stream in flight."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
from e2e_helpers import e2e_cluster

from pdserve.client import Client
from pdserve_api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.slow  # clusters stopped under load, drain timeouts

DRAIN_S = 3.0
SLACK_S = 2.0  # the bound: exit within drain timeout + 2 s


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama", num_heads=4, num_kv_heads=1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny):
    drain = ["--drain-timeout-s", str(DRAIN_S)]
    c = e2e_cluster(
        tmp_path_factory.mktemp("clean-stop"),
        tiny,
        num_prefill=1,
        num_decode=1,
        prefill_tp=2,
        decode_tp=2,
        decode_dcp=2,
        router_args=drain,
        prefill_args=drain,
        decode_args=drain,
    )
    c.start()
    yield c
    c.stop()


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def sigterm_and_time(cluster, name: str) -> float:
    """SIGTERM the service's main process; seconds until it and its whole group are gone (asserts code 0)."""
    proc = cluster.service(name).proc
    t0 = time.monotonic()
    proc.terminate()
    try:
        rc = proc.wait(DRAIN_S + SLACK_S + 10)
    except Exception:
        raise AssertionError(
            f"{name} still runs {DRAIN_S + SLACK_S + 10:g}s after SIGTERM:\n" + cluster.service(name).log_tail(40)
        ) from None
    while not _group_gone(proc.pid) and time.monotonic() - t0 < DRAIN_S + SLACK_S + 10:
        time.sleep(0.02)
    took = time.monotonic() - t0
    assert rc == 0, f"{name} exited with {rc}:\n" + cluster.service(name).log_tail(40)
    assert _group_gone(proc.pid), f"{name}'s rank processes outlived it"
    return took


def restart(cluster, name: str) -> None:
    """Start it again and wait until the router serves the model (both roles registered) once more."""
    cluster.restart(name)
    with Client(cluster.router_address) as c:
        c.wait_ready(60)


@pytest.mark.parametrize("name", ["p0", "d0", "router"])
def test_idle_service_stops_at_once(cluster, name):
    took = sigterm_and_time(cluster, name)
    assert took < SLACK_S, f"idle {name} took {took:.2f}s to stop"
    restart(cluster, name)


def test_busy_decode_pod_and_router_stop_within_the_drain_timeout(cluster):
    """A stream that would outlast the drain timeout: the decode pod cuts it at the deadline and exits; the client
    gets an error, not a hang. Then the same for the router with a stream in flight."""
    for name in ("d0", "router"):
        outcome: dict[str, object] = {}
        started = threading.Event()

        def stream(started: threading.Event = started, outcome: dict[str, object] = outcome) -> None:
            try:
                with Client(cluster.router_address) as c:
                    for _ in c.generate_stream([1, 5, 9, 13], max_tokens=3500, temperature=0, ignore_eos=True):
                        started.set()
                outcome["end"] = "finished"
            except Exception as e:  # the pod or router went away mid-stream: an error the caller sees
                outcome["end"] = e
            finally:
                started.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(60) and "end" not in outcome, outcome
        took = sigterm_and_time(cluster, name)
        assert took < DRAIN_S + SLACK_S, f"busy {name} took {took:.2f}s to stop (drain timeout {DRAIN_S:g}s)"
        t.join(30)
        assert not t.is_alive(), "the client's stream hangs after the service stopped"
        end = outcome["end"]
        assert end == "finished" or isinstance(end, Exception), end
        restart(cluster, name)


def test_busy_prefill_pod_stops_within_the_drain_timeout(cluster):
    """A KV lease held for a decode pod that never reads it: the prefill pod waits for it until the drain timeout,
    then drops it and exits."""
    decode = decode_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(cluster.service("d0").address))
    prefill = prefill_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(cluster.service("p0").address))
    ids = [1, 7, 11, 13, 17, 19, 23, 29, 31]
    alloc = decode.AllocateKV(decode_pb2.AllocateKVRequest(request_id="held", num_tokens=len(ids)), timeout=30)
    pre = prefill.Prefill(
        prefill_pb2.PrefillRequest(
            request_id="held",
            prompt_token_ids=ids,
            sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            decode_target=prefill_pb2.DecodeTarget(
                decode_pod_id="d0",
                layout=alloc.layout,
                transfer_modes=alloc.transfer_modes,
            ),
        ),
        timeout=60,
    )
    assert pre.kv_handle.kv_transfer_address
    took = sigterm_and_time(cluster, "p0")
    assert DRAIN_S - 0.5 < took < DRAIN_S + SLACK_S, f"busy prefill pod took {took:.2f}s (drain {DRAIN_S:g}s)"
    assert "drain timeout" in cluster.service("p0").log_tail(40)
    decode.CancelDecode(decode_pb2.CancelDecodeRequest(request_id="held"), timeout=10)
    restart(cluster, "p0")
