"""Registry over real gRPC (in-process router on loopback): registration with config validation, heartbeats,
health and eviction, ClusterStatus."""

from __future__ import annotations

import grpc
import pytest
from router_helpers import FakeClock, register_request, run, running_router, stubs

from pdserve_api.v1 import common_pb2, registry_pb2, router_pb2
from router.placement import rendezvous

PREFILL, DECODE = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE


def test_valid_pods_register_and_show_in_cluster_status():
    async def body():
        async with running_router() as (server, ch):
            router, registry = stubs(ch)
            r = await registry.RegisterWorker(register_request("p0", PREFILL, tp=1))
            assert r.accepted and r.heartbeat_interval_s == 1.0 and r.router_id
            r = await registry.RegisterWorker(register_request("d0", DECODE, tp=4, dcp=2, num_blocks=64))
            assert r.accepted, r.message
            st = await router.ClusterStatus(router_pb2.ClusterStatusRequest())
            assert [p.pod_id for p in st.pods] == ["p0", "d0"]
            d0 = st.pods[1]
            assert d0.parallel.tensor_parallel_size == 4 and d0.parallel.decode_context_parallel_size == 2
            assert [(k.rank, k.free_blocks, k.total_blocks) for k in d0.kv] == [(r, 64, 64) for r in range(4)]
            assert d0.state == common_pb2.POD_STATE_READY
            assert d0.kv_layout.dcp_size == 2
            assert list(st.ready_models) == ["SmolLM2-135M-Instruct"]
            only = await router.ClusterStatus(router_pb2.ClusterStatusRequest(role=DECODE))
            assert [p.pod_id for p in only.pods] == ["d0"]
            none = await router.ClusterStatus(router_pb2.ClusterStatusRequest(model="other"))
            assert not none.pods

    run(body())


@pytest.mark.parametrize(
    "req_kw,needle",
    [
        # vLLM's rule, with its message and the fix (8 KV heads, TP 8, DCP 2 -> TP 16).
        (
            dict(role=DECODE, tp=8, dcp=2, heads=32, kv_heads=8),
            "Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (8) to be greater than "
            "the model's total number of KV heads (8)",
        ),
        (dict(role=DECODE, tp=3, heads=8, kv_heads=2), "Total number of attention heads (8) must be divisible by"),
        (dict(role=DECODE, tp=4, dcp=3), "tp_size=4 must be divisible by dcp_size=3"),
        (dict(role=PREFILL, tp=4, dcp=2), "decode context parallelism is for decode pods only"),
        (dict(role=DECODE, model="another-model"), "is not served by this router"),
    ],
)
def test_invalid_pods_are_refused_with_the_rule_and_fix(req_kw, needle):
    async def body():
        async with running_router() as (server, ch):
            router, registry = stubs(ch)
            r = await registry.RegisterWorker(register_request("bad", **req_kw))
            assert not r.accepted
            assert needle in r.message, r.message
            st = await router.ClusterStatus(router_pb2.ClusterStatusRequest())
            assert not st.pods

    run(body())


@pytest.mark.parametrize(
    "req_kw, needle",
    [
        (dict(role=common_pb2.ROLE_UNSPECIFIED), "role must be"),
        (dict(role=DECODE, address="no-port"), "is not host:port"),
    ],
)
def test_malformed_registrations_are_invalid_argument(req_kw, needle):
    """A registration no pod could mean (unknown role, an address that is not host:port) is INVALID_ARGUMENT with a
    message naming the field, and nothing is registered."""

    async def body():
        async with running_router() as (server, ch):
            router, registry = stubs(ch)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await registry.RegisterWorker(register_request("bad", **req_kw))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in ei.value.details(), ei.value.details()
            st = await router.ClusterStatus(router_pb2.ClusterStatusRequest())
            assert not st.pods

    run(body())


def test_refusal_carries_the_fix():
    async def body():
        async with running_router() as (server, ch):
            _, registry = stubs(ch)
            r = await registry.RegisterWorker(register_request("bad", DECODE, tp=8, dcp=2, heads=32, kv_heads=8))
            assert "Fix:" in r.message and "--tensor-parallel-size 16" in r.message, r.message

    run(body())


def test_shape_mismatch_with_registered_pods_is_refused():
    async def body():
        async with running_router() as (server, ch):
            _, registry = stubs(ch)
            assert (await registry.RegisterWorker(register_request("p0", PREFILL))).accepted
            r = await registry.RegisterWorker(register_request("d0", DECODE, tp=2, kv_heads=4))
            assert not r.accepted and "num_kv_heads" in r.message

    run(body())


def test_kv_dtype_mismatch_between_prefill_and_decode_is_refused():
    async def body():
        async with running_router() as (server, ch):
            _, registry = stubs(ch)
            pre = register_request("p0", PREFILL)
            pre.model_shape.dtype = pre.kv_layout.dtype = "bfloat16"
            assert (await registry.RegisterWorker(pre)).accepted
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await registry.RegisterWorker(register_request("d0", DECODE))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert e.value.details() == (
                "KV dtype mismatch: prefill pod 'p0' runs bfloat16, decode pod 'd0' runs float32, and "
                "KV moves between them as raw bytes: start both with the same --dtype (e.g. --dtype "
                "bfloat16 on decode pod 'd0')"
            ), e.value.details()
            assert "d0" not in server.core.registry.pods

    run(body())


@pytest.mark.parametrize("first", [PREFILL, DECODE])
def test_mixed_kv_cache_dtypes_are_refused_at_registration(first):
    """An fp8 pod and a model-dtype pod of the other role: FAILED_PRECONDITION naming both pods and the flag, in
    either order of registration; pods of the same fp8 dtype register."""

    async def body():
        async with running_router() as (server, ch):
            _, registry = stubs(ch)
            pre, dec = register_request("p0", PREFILL), register_request("d0", DECODE)
            pre.kv_layout.dtype = "float8_e4m3fn"
            pre.kv_layout.element_size = 1
            a, b = (pre, dec) if first == PREFILL else (dec, pre)
            assert (await registry.RegisterWorker(a)).accepted
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await registry.RegisterWorker(b)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            msg = e.value.details()
            assert "prefill pod 'p0' stores its KV cache as float8_e4m3fn" in msg, msg
            assert "decode pod 'd0' as float32" in msg and "--kv-cache-dtype fp8_e4m3 on decode pod 'd0'" in msg, msg
            dec.kv_layout.dtype = "float8_e4m3fn"
            dec.kv_layout.element_size = 1
            assert (await registry.RegisterWorker(dec)).accepted
            assert (await registry.RegisterWorker(pre)).accepted

    run(body())


def test_decode_pod_refuses_a_prefill_layout_of_another_dtype():
    from decode_svc.server import _layout_mismatch

    mine = common_pb2.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    theirs = common_pb2.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16")
    msg = _layout_mismatch(theirs, mine)
    assert msg is not None and "bfloat16" in msg and "float32" in msg and "--dtype" in msg
    assert _layout_mismatch(mine, mine) is None


def test_cluster_token_is_checked():
    async def body():
        async with running_router(cluster_token="s3cret") as (server, ch):
            _, registry = stubs(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await registry.RegisterWorker(register_request("p0", PREFILL))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = register_request("p0", PREFILL)
            ok.cluster_token = "s3cret"
            assert (await registry.RegisterWorker(ok)).accepted
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await registry.Heartbeat(registry_pb2.HeartbeatRequest(pod_id="p0"))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    run(body())


def test_heartbeats_update_load_and_kv_then_silence_marks_unhealthy_then_evicts():
    clock = FakeClock()

    async def body():
        async with running_router(clock=clock, heartbeat_interval_s=1.0, eviction_timeout_s=10.0) as (server, ch):
            router, registry = stubs(ch)
            reg = server.core.registry
            assert (await registry.RegisterWorker(register_request("d0", DECODE, tp=2, num_blocks=50))).accepted
            hb = registry_pb2.HeartbeatRequest(
                pod_id="d0",
                load=common_pb2.LoadStats(num_running_seqs=3),
                kv=[common_pb2.RankKVStats(rank=r, free_blocks=40 - r, total_blocks=50) for r in range(2)],
            )
            clock.t += 0.9
            r = await registry.Heartbeat(hb)
            assert r.known
            st = (await router.ClusterStatus(router_pb2.ClusterStatusRequest())).pods[0]
            assert st.load.num_running_seqs == 3 and [k.free_blocks for k in st.kv] == [40, 39]
            # 3 missed intervals: unhealthy, no traffic.
            clock.t += 3.5
            reg.tick()
            assert reg.pods["d0"].state == common_pb2.POD_STATE_UNHEALTHY
            assert reg.decode_views() == []
            # A heartbeat brings it back.
            assert (await registry.Heartbeat(hb)).known
            assert reg.pods["d0"].state == common_pb2.POD_STATE_READY
            # Silent past the eviction timeout: dropped; its next heartbeat is told to re-register.
            clock.t += 10.5
            assert reg.tick() == ["d0"]
            assert not (await router.ClusterStatus(router_pb2.ClusterStatusRequest())).pods
            assert not (await registry.Heartbeat(hb)).known

    run(body())


def test_draining_pod_gets_no_traffic_and_deregister():
    async def body():
        async with running_router() as (server, ch):
            _, registry = stubs(ch)
            reg = server.core.registry
            await registry.RegisterWorker(register_request("d0", DECODE))
            await registry.Heartbeat(registry_pb2.HeartbeatRequest(pod_id="d0", state=common_pb2.POD_STATE_DRAINING))
            assert reg.pods["d0"].state == common_pb2.POD_STATE_DRAINING and not reg.decode_views()
            assert (await registry.DeregisterWorker(registry_pb2.DeregisterWorkerRequest(pod_id="d0"))).found
            assert not (await registry.DeregisterWorker(registry_pb2.DeregisterWorkerRequest(pod_id="d0"))).found

    run(body())


def test_reregistration_replaces_the_entry():
    async def body():
        async with running_router() as (server, ch):
            _, registry = stubs(ch)
            await registry.RegisterWorker(register_request("d0", DECODE, num_blocks=10))
            await registry.RegisterWorker(register_request("d0", DECODE, num_blocks=20))
            e = server.core.registry.pods["d0"]
            assert e.kv_total == [20]
            assert len(server.core.registry.pods) == 1

    run(body())


def test_watchdog_runs_on_its_own():
    """With a real clock and a short interval the server's watchdog marks a silent pod unhealthy by itself."""
    import asyncio

    async def body():
        async with running_router(heartbeat_interval_s=0.1, missed_heartbeats_unhealthy=2, eviction_timeout_s=0.6) as (
            server,
            ch,
        ):
            _, registry = stubs(ch)
            await registry.RegisterWorker(register_request("d0", DECODE))
            await asyncio.sleep(0.35)
            assert server.core.registry.pods["d0"].state == common_pb2.POD_STATE_UNHEALTHY
            await asyncio.sleep(0.6)
            assert "d0" not in server.core.registry.pods

    run(body())


def test_prefix_affinity_and_load_through_the_core():
    """Through RouterCore: a request sharing its first blocks with an earlier one goes to the same prefill pod; one
    without a full block goes to the less loaded pod; an unseen prefix goes to its rendezvous pod; the affinity pod
    loses once it is overloaded."""

    async def body():
        async with running_router(affinity_max_imbalance_tokens=100) as (server, ch):
            _, registry = stubs(ch)
            core = server.core
            for p in ("p0", "p1"):
                await registry.RegisterWorker(register_request(p, PREFILL))
            shared = list(range(10, 42))  # two full blocks

            async def prep(ids):
                return await core.prepare(router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids)))

            a = await prep(shared + [1, 2, 3])
            first = core.pick_prefill(a, set())
            other = {"p0": "p1", "p1": "p0"}[first]
            b = await prep(list(range(100, 110)))  # no full block, so no affinity key
            assert core.pick_prefill(b, set()) == other  # least loaded (a's tokens are booked on `first`)
            c = await prep(shared + [7, 8])
            assert core.pick_prefill(c, set()) == first  # affinity: same first blocks
            e = await prep(list(range(200, 240)))  # unseen full blocks: the pod every replica would pick
            assert core.pick_prefill(e, set()) == rendezvous(e.affinity_key, ["p0", "p1"])
            # Overload `first` (beyond the 100-token imbalance): affinity yields to load.
            core.registry.start_prefill(first, 500)
            d = await prep(shared + [9])
            assert core.pick_prefill(d, set()) == other

    run(body())
