"""A real cluster (router, prefill pod, decode pod as separate processes) with mutual TLS everywhere (gRPC and the KV
control channel), a cluster token
and an API key: a TLS client with the key gets the right tokens end to end; a pod with the wrong token is refused by
the Registry and never listed; a KV handshake without the cluster token is refused by the prefill pod's publisher;
oversized messages to the pods are refused while they keep serving."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_helpers import REPO, e2e_cluster, service_env, wait_for_log
from security_helpers import Pki, make_pki

from kv_transfer.control import ControlClient, KVAuthError
from kv_transfer.transport import PROTOCOL_VERSION, Endpoint, HandshakeTimeout, TransferUnavailable
from pdserve.cli_config import argv_for
from pdserve.client import Client
from pdserve.cluster.supervisor import LocalCluster
from pdserve.security import MAX_MESSAGE_BYTES, TLSConfig, sync_channel
from pdserve_api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prefill_svc.config import PrefillConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # slow: an mTLS cluster with pods

TOKEN = "cluster-s3cret"
KEY = "client-k3y"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path):
    from pdserve.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-sec"), "llama", num_kv_heads=1, tokenizer_from=smollm2_path
    )


def service_tls(pki: Pki) -> TLSConfig:
    """What every service serves (mutual TLS); the supervisor presents the same certificate when it checks them."""
    return TLSConfig(
        cert_file=str(pki.server_cert), key_file=str(pki.server_key), ca_file=str(pki.ca), require_client_cert=True
    )


def client_tls(pki: Pki) -> TLSConfig:
    return TLSConfig(cert_file=str(pki.client_cert), key_file=str(pki.client_key), ca_file=str(pki.ca))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model, pki):
    c = e2e_cluster(
        tmp_path_factory.mktemp("cluster"),
        tiny_model,
        num_prefill=1,
        num_decode=1,
        decode_tp=1,
        decode_dcp=1,
        num_kv_blocks=128,
        prefill_args=["--kv-transport", "tcp"],
        decode_args=["--kv-transfer-backend", "tcp"],
        tls=service_tls(pki),
        cluster_token=TOKEN,
        api_key=KEY,
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


def sdk(c: LocalCluster, pki: Pki) -> Client:
    return Client(
        c.router_address,
        root_ca=str(pki.ca),
        client_cert=str(pki.client_cert),
        client_key=str(pki.client_key),
        api_key=KEY,
        timeout=120,
    )


def test_mtls_client_with_key_gets_the_reference_tokens(cluster, tiny_model, pki):
    """Client -> router -> prefill -> (KV over the authenticated control channel) -> decode -> client, all over
    mutual TLS: greedy tokens equal the engine's own greedy output."""
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams

    prompt = [5, 17, 99, 42, 7, 3, 250, 11, 64, 128, 200, 31, 9]
    with LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64, enable_prefix_caching=False)) as eng:
        want = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]["token_ids"]
    with sdk(cluster, pki) as c:
        got = c.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    assert list(got.token_ids) == want


def test_pod_with_wrong_token_is_refused_and_never_listed(cluster, tiny_model, pki):
    """A prefill pod (valid certificate) presenting the wrong cluster token: the Registry answers UNAUTHENTICATED
    (the pod logs it) and the pod never appears in ClusterStatus."""
    tls = service_tls(pki)
    argv = argv_for(
        PrefillConfig,
        model=str(tiny_model),
        port=0,
        pod_id="intruder",
        router_address=cluster.router_address,
        cluster_token="guess",
        kv_transport="none",
        heartbeat_interval_s=0.25,
        tls_cert_file=tls.cert_file,
        tls_key_file=tls.key_file,
        tls_ca_file=tls.ca_file,
        tls_require_client_cert=True,
    )
    log = cluster.log_dir / "intruder.log"
    with open(log, "wb") as out:  # a pod outside the cluster: started by hand, not by the supervisor
        bad = subprocess.Popen(
            [sys.executable, "-m", "prefill_svc", *argv],
            cwd=REPO,
            env=service_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_log(bad, log, r"UNAUTHENTICATED", timeout=300)
        with sdk(cluster, pki) as c:
            for _ in range(3):  # several heartbeat intervals later: still not there
                assert "intruder" not in {p.pod_id for p in c.cluster_status().pods}
                time.sleep(0.3)
    finally:
        bad.kill()
        bad.wait(timeout=30)


def _pods(cluster: LocalCluster, pki: Pki) -> dict[int, common_pb2.Role]:
    with sdk(cluster, pki) as c:
        return {p.role: p for p in c.cluster_status().pods}


def test_kv_handshake_without_the_cluster_token_is_refused(cluster, pki):
    """The prefill pod's KV publisher (serving mutual TLS, as its pod does): a peer with a valid client certificate
    but without the token, or with a wrong one, is refused at once with an error naming the cluster token, and the
    connection is closed (nothing served); a plaintext peer, even holding the token, never gets through; with TLS
    and the token the handshake answers."""
    pre = _pods(cluster, pki)[common_pb2.ROLE_PREFILL]
    ep = Endpoint.parse(pre.kv_transfer_address.split(",")[0])
    hello = {"op": "hello", "version": PROTOCOL_VERSION, "transport": "tcp"}
    tls = client_tls(pki)

    anon = ControlClient(ep, io_timeout_s=10, auth_token="", tls=tls)
    anon.connect(10)
    with pytest.raises(KVAuthError, match="cluster-token"):
        anon.call(hello, handshake=True)
    with pytest.raises(TransferUnavailable):  # the publisher hung up
        anon.call(hello)
    anon.close()

    with pytest.raises(KVAuthError, match="wrong cluster token"):
        ControlClient(ep, io_timeout_s=10, auth_token="guess", tls=tls).connect(10)
    with pytest.raises(HandshakeTimeout):
        ControlClient(ep, io_timeout_s=3, auth_token=TOKEN, tls=None).connect(5)

    ok = ControlClient(ep, io_timeout_s=10, auth_token=TOKEN, tls=tls)
    ok.connect(10)
    reply, _ = ok.call(hello, handshake=True)
    assert reply["version"] == PROTOCOL_VERSION and reply["layout"]["num_layers"] >= 1
    ok.close()


def _refused_then_healthy(address: str, tls: TLSConfig, call) -> None:
    opts = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
    with sync_channel(address, tls, options=opts) as ch:
        with pytest.raises(grpc.RpcError) as e:
            call(ch)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert h.status == health_pb2.HealthCheckResponse.SERVING


def test_oversized_messages_to_pods_are_refused_and_pods_keep_serving(cluster, pki):
    """Prefill and decode pods enforce the shared message limit: RESOURCE_EXHAUSTED, then still SERVING (and the
    cluster still generates)."""
    pods = _pods(cluster, pki)
    big = "x" * (MAX_MESSAGE_BYTES + 1024)
    tls = client_tls(pki)
    _refused_then_healthy(
        pods[common_pb2.ROLE_PREFILL].address,
        tls,
        lambda ch: prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(
            prefill_pb2.PrefillRequest(request_id=big), timeout=60
        ),
    )
    _refused_then_healthy(
        pods[common_pb2.ROLE_DECODE].address,
        tls,
        lambda ch: decode_pb2_grpc.DecodeWorkerStub(ch).AllocateKV(
            decode_pb2.AllocateKVRequest(request_id=big, num_tokens=1), timeout=60
        ),
    )
    with sdk(cluster, pki) as c:
        assert len(c.generate([5, 6, 7], max_tokens=2, temperature=0, ignore_eos=True).token_ids) == 2


def test_plaintext_pod_channel_is_refused(cluster, pki):
    """The pods themselves serve mutual TLS: a plaintext channel and a TLS channel without a client certificate
    get nothing from them."""
    pods = _pods(cluster, pki)
    for role in (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE):
        for tls in (None, TLSConfig(ca_file=str(pki.ca))):
            with sync_channel(pods[role].address, tls) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
