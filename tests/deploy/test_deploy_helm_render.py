"""What the chart renders: router Deployment + Service, prefill Deployment, decode pods as StatefulSet or
LeaderWorkerSet, GPU resources and node selectors, gRPC probes, PDBs, optional HPA and ServiceMonitor, TLS and the
cluster token, and a config the image's entrypoint turns into flags the services accept."""

from __future__ import annotations

import base64

import pytest
import yaml
from deploy_helpers import REPO, checks, docs_of, entrypoint, find

EX = REPO / "deploy" / "helm" / "examples"
LWS_API = "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet"


def _rendered(render, values=(), sets=(), api_versions=()):
    r = render(values, sets, api_versions)
    assert r.ok, r.output
    return docs_of(r.output)


def _container(workload: dict) -> dict:
    spec = workload["spec"]
    pod = spec["leaderWorkerTemplate"]["workerTemplate"] if workload["kind"] == "LeaderWorkerSet" else spec["template"]
    (c,) = pod["spec"]["containers"]
    return c


def _pod_spec(workload: dict) -> dict:
    spec = workload["spec"]
    pod = spec["leaderWorkerTemplate"]["workerTemplate"] if workload["kind"] == "LeaderWorkerSet" else spec["template"]
    return pod["spec"]


def test_default_render(render):
    docs = _rendered(render)
    (router,) = find(docs, "Deployment", "router")
    (prefill,) = find(docs, "Deployment", "prefill")
    (decode,) = find(docs, "StatefulSet", "decode")  # no LWS API announced: StatefulSet
    assert not find(docs, "LeaderWorkerSet") and not find(docs, "HorizontalPodAutoscaler")
    assert not find(docs, "ServiceMonitor")
    services = {s["metadata"]["name"]: s for s in find(docs, "Service")}
    assert services["pdserve-router"]["spec"]["type"] == "ClusterIP"
    assert services["pdserve-decode"]["spec"]["clusterIP"] == "None"
    assert decode["spec"]["serviceName"] == "pdserve-decode"
    assert {p["metadata"]["name"] for p in find(docs, "PodDisruptionBudget")} == {
        "pdserve-router",
        "pdserve-prefill",
        "pdserve-decode",
    }
    for w, port in ((router, 50051), (prefill, 50052), (decode, 50053)):
        c = _container(w)
        assert c["args"] == [w["metadata"]["labels"]["app.kubernetes.io/component"]]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}
        assert "nvidia.com/gpu" not in yaml.safe_dump(c["resources"])
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert _pod_spec(w)["securityContext"]["runAsNonRoot"] is True
    # The cluster token: a chart-managed Secret, mounted as a file the entrypoint reads.
    (secret,) = find(docs, "Secret")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 40
    env = {e["name"]: e.get("value") for e in _container(router)["env"]}
    assert env["PDSERVE_CLUSTER_TOKEN_FILE"] == "/etc/pdserve/token/token"
    assert "PDSERVE_TLS_CERT_FILE" not in env


def test_decode_workload_follows_the_lws_api(render):
    docs = _rendered(render, api_versions=[LWS_API])
    (lws,) = find(docs, "LeaderWorkerSet", "decode")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 1
    assert not find(docs, "StatefulSet")
    forced = _rendered(render, sets=["decode.workload=StatefulSet"], api_versions=[LWS_API])
    assert find(forced, "StatefulSet", "decode") and not find(forced, "LeaderWorkerSet")


def test_gpu_one_node(render):
    docs = _rendered(render, [EX / "gpu-1node.yaml"], api_versions=checks.EXAMPLE_API_VERSIONS["gpu-1node"])
    (prefill,) = find(docs, "Deployment", "prefill")
    (decode,) = find(docs, "StatefulSet", "decode")
    assert prefill["spec"]["replicas"] == 2
    assert _container(prefill)["resources"]["limits"]["nvidia.com/gpu"] == 2  # TP
    assert _container(decode)["resources"]["limits"]["nvidia.com/gpu"] == 4  # TP (DCP reuses the TP ranks)
    assert _container(decode)["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert _pod_spec(decode)["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "nvidia.com/gpu" not in yaml.safe_dump(_container(find(docs, "Deployment", "router")[0])["resources"])
    (sm,) = find(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    dshm = next(v for v in _pod_spec(decode)["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}


def test_deepseek_v3_mla_decode_tp8_dcp8(render):
    """The MLA example passes the chart's parallel check (tp % dcp only) and runs decode as TP 8 x DCP 8."""
    docs = _rendered(render, [EX / "deepseek-v3-gpu.yaml"])
    (prefill,) = find(docs, "Deployment", "prefill")
    (decode,) = find(docs, "StatefulSet", "decode")
    assert decode["spec"]["replicas"] == 2
    assert _container(prefill)["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert _container(decode)["resources"]["limits"]["nvidia.com/gpu"] == 8  # DCP reuses the TP ranks
    (cm,) = find(docs, "ConfigMap")
    d = entrypoint.resolve("decode", yaml.safe_load(cm["data"]["pdserve.yaml"]), {})
    assert (d["tensor_parallel_size"], d["decode_context_parallel_size"], d["dtype"]) == (8, 8, "bfloat16")
    # The same numbers without MLA (128 KV heads over TP 8) allow no DCP: the chart refuses them.
    refused = render([EX / "deepseek-v3-gpu.yaml"], ["model.useMla=false"])
    assert not refused.ok and "invalid parallel config: Decode context para" in refused.output


def test_multi_node(render):
    docs = _rendered(render, [EX / "multi-node.yaml"], api_versions=checks.EXAMPLE_API_VERSIONS["multi-node"])
    (router,) = find(docs, "Deployment", "router")
    (prefill,) = find(docs, "Deployment", "prefill")
    (lws,) = find(docs, "LeaderWorkerSet", "decode")
    assert "replicas" not in router["spec"] and "replicas" not in prefill["spec"]  # left to the HPAs
    assert {h["spec"]["scaleTargetRef"]["name"] for h in find(docs, "HorizontalPodAutoscaler")} == {
        "pdserve-router",
        "pdserve-prefill",
    }
    assert lws["spec"]["replicas"] == 4
    c = _container(lws)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert _pod_spec(lws)["nodeSelector"] == {"node.kubernetes.io/pool": "decode"}
    # TLS: secret mounted, env for the services, exec probes (kubelet's gRPC probe cannot speak TLS).
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PDSERVE_TLS_CERT_FILE"] == "/etc/pdserve/tls/tls.crt"
    assert env["PDSERVE_TLS_SERVER_NAME"] == "pdserve.internal"
    assert c["readinessProbe"]["exec"]["command"] == ["pdserve-healthcheck", "--port", "50053"]
    tls = next(v for v in _pod_spec(lws)["volumes"] if v["name"] == "tls")
    assert tls["secret"]["secretName"] == "pdserve-tls"
    # The token comes from the existing Secret: the chart makes none.
    assert not find(docs, "Secret")
    tok = next(v for v in _pod_spec(lws)["volumes"] if v["name"] == "cluster-token")
    assert tok["secret"]["secretName"] == "pdserve-cluster-token"
    pdbs = {p["metadata"]["name"]: p["spec"] for p in find(docs, "PodDisruptionBudget")}
    assert pdbs["pdserve-router"].get("minAvailable") == 1 and "maxUnavailable" not in pdbs["pdserve-router"]


@pytest.mark.parametrize("example", ["default", "cpu-dev", "gpu-1node", "multi-node", "mtls", "deepseek-v3-gpu"])
def test_configmap_becomes_service_flags(render, example):
    values = [] if example == "default" else [EX / f"{example}.yaml"]
    docs = _rendered(render, values, api_versions=checks.EXAMPLE_API_VERSIONS.get(example, ()))
    (cm,) = find(docs, "ConfigMap")
    cfg = yaml.safe_load(cm["data"]["pdserve.yaml"])
    chart_values = yaml.safe_load((REPO / "deploy" / "helm" / "pdserve" / "values.yaml").read_text())
    if values:
        ex = yaml.safe_load(values[0].read_text())
        for k in ("decode", "prefill", "model"):
            chart_values[k].update(ex.get(k, {}))
    d = entrypoint.resolve("decode", cfg, {"PDSERVE_ARG_ADVERTISE_HOST": "10.0.0.7"})
    assert d["tensor_parallel_size"] == chart_values["decode"]["tensorParallelSize"]
    assert d["decode_context_parallel_size"] == chart_values["decode"]["decodeContextParallelSize"]
    assert d["router"] == "pdserve-router-headless:50051"  # every router replica (test_headless_router_service)
    assert d["model"] == chart_values["model"]["path"]
    p = entrypoint.resolve("prefill", cfg, {})
    assert p["tensor_parallel_size"] == chart_values["prefill"]["tensorParallelSize"]
    assert p["dtype"] == d["dtype"] == chart_values["model"].get("dtype", "auto")  # one dtype for both roles
    assert "decode_context_parallel_size" not in p
    for role in ("router", "prefill", "decode"):
        s = entrypoint.resolve(role, cfg, {})
        flags = entrypoint.service_flags(role)
        assert flags is not None
        argv = entrypoint.to_flags(entrypoint.fit_to_service(role, s, flags))
        mod = __import__(entrypoint.ROLES[role] + ".__main__", fromlist=["x"])
        parser = next(getattr(mod, n) for n in ("build_parser", "_parser") if hasattr(mod, n))()
        parser.parse_args(argv)  # SystemExit on an unknown flag


def test_tls_without_secret_name_is_refused(render):
    r = render(sets=["tls.enabled=true"])
    assert not r.ok and "tls.secretName" in r.output


def test_grpc_probes_with_tls_are_refused(render):
    r = render(sets=["tls.enabled=true", "tls.secretName=x", "probes.mode=grpc"])
    assert not r.ok and "probes.mode grpc" in r.output


# --- TLS / mutual TLS ------------------------------------------------------------------------------------------------


def _workloads(docs: list[dict]) -> list[dict]:
    return [*find(docs, "Deployment"), *find(docs, "StatefulSet"), *find(docs, "LeaderWorkerSet")]


def _env(workload: dict) -> dict:
    return {e["name"]: e.get("value") for e in _container(workload)["env"]}


def test_default_render_has_no_tls_env(render):
    for w in _workloads(_rendered(render)):
        assert not [k for k in _env(w) if k.startswith(("PDSERVE_TLS_", "PDSERVE_HTTP_TLS_"))], w["metadata"]["name"]


def test_mtls_example_sets_mutual_tls_on_every_service(render):
    docs = _rendered(render, [EX / "mtls.yaml"], api_versions=checks.EXAMPLE_API_VERSIONS["mtls"])
    workloads = _workloads(docs)
    assert {w["metadata"]["labels"]["app.kubernetes.io/component"] for w in workloads} == {
        "router",
        "prefill",
        "decode",
    }
    for w in workloads:
        env = _env(w)
        assert env["PDSERVE_TLS_CERT_FILE"] == "/etc/pdserve/tls/tls.crt"
        assert env["PDSERVE_TLS_KEY_FILE"] == "/etc/pdserve/tls/tls.key"
        assert env["PDSERVE_TLS_CA_FILE"] == "/etc/pdserve/tls/ca.crt"
        assert env["PDSERVE_TLS_SERVER_NAME"] == "pdserve.internal"
        assert env["PDSERVE_TLS_REQUIRE_CLIENT_CERT"] == "true"
        c = _container(w)
        port = str(c["ports"][0]["containerPort"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # exec: docker/healthcheck.py presents tls.crt (tests/deploy/test_deploy_healthcheck_tls.py)
            assert c[probe]["exec"]["command"] == ["pdserve-healthcheck", "--port", port]
        assert {"name": "tls", "mountPath": "/etc/pdserve/tls", "readOnly": True} in c["volumeMounts"]
        tls = next(v for v in _pod_spec(w)["volumes"] if v["name"] == "tls")
        assert tls["secret"]["secretName"] == "pdserve-tls"
    # Metrics stay plain HTTP: the services' Prometheus servers do not serve TLS.
    (sm,) = find(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["scheme"] == "http"


def test_tls_without_mtls_says_so(render):
    docs = _rendered(render, [EX / "multi-node.yaml"], api_versions=checks.EXAMPLE_API_VERSIONS["multi-node"])
    for w in _workloads(docs):
        assert _env(w)["PDSERVE_TLS_REQUIRE_CLIENT_CERT"] == "false"


def test_mtls_without_tls_is_refused(render):
    r = render(sets=["tls.requireClientCert=true"])
    assert not r.ok
    assert "tls.requireClientCert (mutual TLS) needs tls.enabled: true and tls.secretName" in r.output
    r = render(sets=["tls.requireClientCert=true", "tls.secretName=pdserve-tls"])  # a secret alone is not TLS
    assert not r.ok and "tls.requireClientCert" in r.output


def test_require_client_cert_must_be_a_boolean(render):
    r = render(sets=["tls.enabled=true", "tls.secretName=x", "tls.requireClientCert=yes"])
    assert not r.ok and "requireClientCert" in r.output


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
def test_rendered_tls_env_reaches_the_services_as_mutual_tls(render, role, monkeypatch, tmp_path):
    """The services' own parsers, built in the rendered environment (the Secret's files replaced by a test PKI),
    make a server-side mutual-TLS config of it."""
    from deploy_helpers import _load

    from pdserve.security import tls_from_args

    pki = _load("pdserve_security_helpers", REPO / "tests" / "security" / "security_helpers.py").make_pki(tmp_path)
    files = {
        "/etc/pdserve/tls/tls.crt": str(pki.server_cert),
        "/etc/pdserve/tls/tls.key": str(pki.server_key),
        "/etc/pdserve/tls/ca.crt": str(pki.ca),
    }
    docs = _rendered(render, [EX / "mtls.yaml"], api_versions=checks.EXAMPLE_API_VERSIONS["mtls"])
    (w,) = [w for w in _workloads(docs) if w["metadata"]["labels"]["app.kubernetes.io/component"] == role]
    env = {k: files.get(v, v) for k, v in _env(w).items() if k.startswith("PDSERVE_TLS_")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    mod = __import__(entrypoint.ROLES[role] + ".__main__", fromlist=["x"])
    parser = next(getattr(mod, n) for n in ("build_parser", "_parser") if hasattr(mod, n))()
    tls = tls_from_args(parser.parse_args([]))
    assert tls is not None and tls.serves_tls and tls.require_client_cert
    assert (tls.cert_file, tls.ca_file, tls.server_name) == (str(pki.server_cert), str(pki.ca), "pdserve.internal")
    # The entrypoint also passes the files as flags (a service without --tls-* flags is refused, not plaintext).
    settings = entrypoint.resolve(role, {}, env)
    assert settings["tls_cert_file"] == str(pki.server_cert) and settings["tls_ca_file"] == str(pki.ca)


def _pod_argv(role: str, cfg: dict) -> list[str]:
    """The command-line flags the image's entrypoint gives a pod of ``role`` from the rendered pdserve.yaml."""
    return entrypoint.to_flags(
        entrypoint.fit_to_service(role, entrypoint.resolve(role, cfg, {}), entrypoint.service_flags(role))
    )


def test_model_dtype_reaches_both_pods_as_one_flag(render):
    docs = _rendered(render, sets=["model.dtype=bfloat16"])
    (cm,) = find(docs, "ConfigMap")
    cfg = yaml.safe_load(cm["data"]["pdserve.yaml"])
    for role in ("prefill", "decode"):
        argv = _pod_argv(role, cfg)
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert "dtype" not in entrypoint.resolve("router", cfg, {})
    bad = render([], ["model.dtype=fp8"], ())
    assert not bad.ok and "dtype" in bad.output


def test_model_quantization_reaches_both_pods_as_one_flag(render):
    docs = _rendered(render, sets=["model.quantization=int8"])
    (cm,) = find(docs, "ConfigMap")
    cfg = yaml.safe_load(cm["data"]["pdserve.yaml"])
    for role in ("prefill", "decode"):
        argv = _pod_argv(role, cfg)
        assert argv[argv.index("--quantization") + 1] == "int8"
    bad = render([], ["model.quantization=int4"], ())
    assert not bad.ok and "quantization" in bad.output


def test_headless_router_service_points_the_pods_at_every_router(render):
    """multi-node.yaml (two routers, HPA up to 6): beside the ClusterIP Service a headless one (one A record per router
    pod), and prefill and decode pods register through it, on the routers' container port; with it disabled the
    pods use the ClusterIP Service as before."""
    docs = _rendered(render, [EX / "multi-node.yaml"], api_versions=checks.EXAMPLE_API_VERSIONS["multi-node"])
    svcs = {s["metadata"]["name"]: s["spec"] for s in find(docs, "Service", "router")}
    assert set(svcs) == {"pdserve-router", "pdserve-router-headless"}
    head = svcs["pdserve-router-headless"]
    assert head["clusterIP"] == "None" and svcs["pdserve-router"].get("clusterIP") != "None"
    assert head["selector"] == svcs["pdserve-router"]["selector"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in head["ports"]] == [("grpc", 50051, "grpc")]
    (cm,) = find(docs, "ConfigMap")
    cfg = yaml.safe_load(cm["data"]["pdserve.yaml"])
    for role in ("prefill", "decode"):
        assert entrypoint.resolve(role, cfg, {})["router"] == "pdserve-router-headless:50051"
    assert "router" not in entrypoint.resolve("router", cfg, {})
    off = _rendered(
        render,
        [EX / "multi-node.yaml"],
        ["router.headlessService.enabled=false"],
        api_versions=checks.EXAMPLE_API_VERSIONS["multi-node"],
    )
    assert {s["metadata"]["name"] for s in find(off, "Service", "router")} == {"pdserve-router"}
    (cm,) = find(off, "ConfigMap")
    assert (
        entrypoint.resolve("decode", yaml.safe_load(cm["data"]["pdserve.yaml"]), {})["router"] == "pdserve-router:50051"
    )
