"""The pod's Registrar against in-process fake routers: one registration + heartbeat per router address, a DNS
name expanded to all its addresses and re-resolved, deregistration from each on close."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.pod.config import PodConfigError, PodServing
from pdserve.pod.registrar import Registrar, parse_router_addresses
from pdserve_api.v1 import registry_pb2, registry_pb2_grpc


class FakeRouter(registry_pb2_grpc.RegistryServicer):
    def __init__(self) -> None:
        self.registered: list[str] = []
        self.heartbeats = 0
        self.deregistered: list[str] = []

    async def RegisterWorker(self, request, context):
        self.registered.append(request.pod_id)
        return registry_pb2.RegisterWorkerResponse(accepted=True, message="hi", heartbeat_interval_s=0.05)

    async def Heartbeat(self, request, context):
        self.heartbeats += 1
        return registry_pb2.HeartbeatResponse(known=request.pod_id in self.registered)

    async def DeregisterWorker(self, request, context):
        self.deregistered.append(request.pod_id)
        return registry_pb2.DeregisterWorkerResponse()


async def _start(n: int) -> tuple[list[grpc.aio.Server], list[FakeRouter], list[str]]:
    servers, fakes, addrs = [], [], []
    for _ in range(n):
        s = grpc.aio.server()
        f = FakeRouter()
        registry_pb2_grpc.add_RegistryServicer_to_server(f, s)
        port = s.add_insecure_port("127.0.0.1:0")
        await s.start()
        servers.append(s)
        fakes.append(f)
        addrs.append(f"127.0.0.1:{port}")
    return servers, fakes, addrs


def _registrar(addresses, **kw) -> Registrar:
    return Registrar(
        addresses,
        "",
        0.05,
        lambda: registry_pb2.RegisterWorkerRequest(pod_id="p0"),
        lambda: registry_pb2.HeartbeatRequest(pod_id="p0"),
        **kw,
    )


async def _until(pred, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < end, "condition not met in time"
        await asyncio.sleep(0.02)


def test_parse_router_addresses():
    assert parse_router_addresses(" a:1, b:2 ,a:1") == ["a:1", "b:2"]
    for bad in ("a", "a:0", ":5", "a:1,", ""):
        with pytest.raises(ValueError):
            parse_router_addresses(bad)
    assert PodServing(router_address="a:1,b:2").router_addresses == ["a:1", "b:2"]
    assert PodServing().router_addresses == []
    with pytest.raises(PodConfigError, match="router_address"):
        PodServing(router_address="a:1,b")


def test_registers_and_heartbeats_with_every_router_then_deregisters():
    async def main():
        servers, fakes, addrs = await _start(2)
        r = _registrar(",".join(addrs))
        r.start()
        await _until(lambda: all(f.registered and f.heartbeats >= 2 for f in fakes))
        assert r.registered and set(r.routers) == set(addrs)
        await r.close("p0")
        assert [f.deregistered for f in fakes] == [["p0"], ["p0"]]
        for s in servers:
            await s.stop(None)

    asyncio.run(main())


def test_a_name_is_every_address_it_resolves_to_and_is_re_resolved():
    async def main():
        servers, fakes, addrs = await _start(3)
        records = {"routers.svc": addrs[:2]}

        async def resolve(host: str, port: int) -> list[str]:
            if host not in records:
                raise OSError("no such name")
            return list(records[host])

        r = _registrar(["routers.svc:1"], resolve=resolve, resolve_interval_s=0.05)
        r.start()
        await _until(lambda: fakes[0].registered and fakes[1].registered)
        assert not fakes[2].registered
        records["routers.svc"] = [addrs[1], addrs[2]]  # a replica went, another came
        await _until(lambda: bool(fakes[2].registered) and set(r.routers) == {addrs[1], addrs[2]})
        del records["routers.svc"]  # DNS hiccup: keep what it resolved to last
        await asyncio.sleep(0.2)
        assert set(r.routers) == {addrs[1], addrs[2]}
        beats = fakes[0].heartbeats
        await asyncio.sleep(0.2)
        assert fakes[0].heartbeats == beats  # no heartbeats to the router that left
        await r.close("p0")
        assert fakes[1].deregistered == ["p0"] and fakes[2].deregistered == ["p0"]
        for s in servers:
            await s.stop(None)

    asyncio.run(main())
