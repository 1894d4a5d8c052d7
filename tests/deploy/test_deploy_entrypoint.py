"""docker/entrypoint.py (YAML + environment -> service command line, parallel-config check before start) and
docker/healthcheck.py (grpc.health.v1 probe), without a container."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from deploy_helpers import REPO, entrypoint, healthcheck
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.commands.validate import main_validate


def _model_dir(tmp_path: Path, heads: int, kv: int) -> Path:
    d = tmp_path / f"model-{heads}-{kv}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_attention_heads": heads, "num_key_value_heads": kv}))
    return d


def test_precedence_defaults_yaml_env():
    cfg = {
        "common": {"model": "/m", "tensor_parallel_size": 4, "decode_context_parallel_size": 2},
        "decode": {"tensor_parallel_size": 2, "port": 6000},
    }
    env = {
        "PDSERVE_ARG_PORT": "7000",
        "PDSERVE_ARG_DCP_KV_CACHE_INTERLEAVE_SIZE": "",  # empty: ignored
        "PDSERVE_ARG_ROUTER": "null",
        "PDSERVE_ARG_MAX_NUM_SEQS": "8",
        "OTHER": "x",
    }
    s = entrypoint.resolve("decode", cfg, env)
    assert s == {
        "host": "0.0.0.0",
        "port": 7000,
        "model": "/m",
        "tensor_parallel_size": 2,
        "decode_context_parallel_size": 2,
        "max_num_seqs": 8,
    }
    # DCP keys from `common:` never reach prefill or the router; the router gets no --router.
    p = entrypoint.resolve("prefill", cfg, {})
    assert "decode_context_parallel_size" not in p and p["tensor_parallel_size"] == 4 and p["router"] == "router:50051"
    r = entrypoint.resolve("router", cfg, {})
    assert "router" not in r and r["port"] == 50051


def test_flags():
    assert entrypoint.to_flags(
        {"tensor_parallel_size": 2, "enforce_eager": True, "no_prefix_caching": False, "x": [1, 2], "model": "/m"}
    ) == ["--tensor-parallel-size", "2", "--enforce-eager", "--x", "1", "--x", "2", "--model", "/m"]
    with pytest.raises(entrypoint.EntrypointError):
        entrypoint.to_flags({"bad": {"nested": 1}})


def test_bad_yaml_sections_are_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("decoder: {port: 1}\n")
    with pytest.raises(entrypoint.EntrypointError, match="unknown section 'decoder'"):
        entrypoint.load_file(f)
    assert entrypoint.load_file(tmp_path / "missing.yaml") == {}


def test_plumbing_keys_follow_the_service_flags():
    s = {"port": 1, "router": "r:1", "advertise_host": "h", "cluster_token": "t", "tensor_parallel_size": 2}
    fitted = entrypoint.fit_to_service("decode", s, {"--port", "--tensor-parallel-size"})
    assert fitted == {"port": 1, "tensor_parallel_size": 2}
    assert entrypoint.fit_to_service("decode", s, None) == s  # parser unreadable: everything passes
    # TLS the service cannot serve is refused, never silently dropped.
    with pytest.raises(entrypoint.EntrypointError, match="refusing to serve plaintext"):
        entrypoint.fit_to_service("router", {"tls_cert_file": "/c"}, {"--port"})


@pytest.mark.parametrize("role", ["router", "prefill", "decode", "openai"])
def test_compose_settings_are_accepted_by_the_service_parser(role):
    """The flags the image would pass (compose YAML + env) parse with the service's real argparse parser."""
    cfg = yaml.safe_load((REPO / "docker" / "config" / "pdserve.yaml").read_text())
    env = {
        "PDSERVE_ARG_ADVERTISE_HOST": role,
        "PDSERVE_CLUSTER_TOKEN": "t",
        "PDSERVE_LOG_LEVEL": "info",
        "PDSERVE_ARG_METRICS_PORT": "9400",
        "PDSERVE_ARG_POD_ID": f"{role}-0",
    }
    settings = entrypoint.resolve(role, cfg, env)
    flags = entrypoint.service_flags(role)
    assert flags is not None, f"{role}: parser not found"
    argv = entrypoint.to_flags(entrypoint.fit_to_service(role, settings, flags))
    mod = __import__(entrypoint.FLAGS_MODULE.get(role, entrypoint.ROLES[role] + ".__main__"), fromlist=["x"])
    parser = next(getattr(mod, n) for n in ("build_parser", "_parser", "parser") if hasattr(mod, n))()
    ns = parser.parse_args(argv)
    assert ns.port == settings["port"] and ns.host == "0.0.0.0"


def test_refused_config_exits_2_with_pdserve_validate_output(tmp_path, capsys, monkeypatch):
    model = _model_dir(tmp_path, 9, 3)  # SmolLM2's shape
    cfg = tmp_path / "pdserve.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"common": {"model": str(model)}, "decode": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}}
        )
    )
    monkeypatch.setattr(entrypoint.os, "execve", lambda *a: pytest.fail("must not start the service"))
    assert entrypoint.main(["decode"], {"PDSERVE_CONFIG": str(cfg), "PDSERVE_RUN_DIR": str(tmp_path)}) == 2
    ours = capsys.readouterr().err
    assert (
        main_validate(["--model", str(model), "--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"])
        == 2
    )
    theirs = capsys.readouterr().err
    assert ours == theirs and ours.startswith("invalid parallel config: Total number of attention heads (9)")


def test_start_execs_the_service_with_the_token_from_the_secret_file(tmp_path, monkeypatch, capsys):
    model = _model_dir(tmp_path, 8, 1)  # the tiny DCP model's shape
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cfg = tmp_path / "pdserve.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"common": {"model": str(model)}, "decode": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}}
        )
    )
    calls = []
    monkeypatch.setattr(entrypoint.os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    monkeypatch.setattr(
        entrypoint,
        "service_flags",
        lambda role: {
            "--port",
            "--host",
            "--model",
            "--cluster-token",
            "--tensor-parallel-size",
            "--decode-context-parallel-size",
        },
    )
    env = {
        "PDSERVE_CONFIG": str(cfg),
        "PDSERVE_RUN_DIR": str(tmp_path / "run"),
        "PDSERVE_CLUSTER_TOKEN_FILE": str(token),
    }
    entrypoint.main(["decode", "--max-num-seqs", "4"], env)
    ((path, argv, child_env),) = calls
    assert argv[1:3] == ["-m", "decode_svc"] and argv[-2:] == ["--max-num-seqs", "4"]
    assert "--decode-context-parallel-size" in argv and "--router" not in argv
    assert child_env["PDSERVE_CLUSTER_TOKEN"] == "s3cret"  # for services that read it from the environment
    assert argv[argv.index("--cluster-token") + 1] == "s3cret"  # for those with the flag
    assert "s3cret" not in capsys.readouterr().err  # the logged command line masks it
    assert json.loads((tmp_path / "run" / "health.json").read_text()) == {"role": "decode", "port": 50053}


def test_print_args_cli_runs_as_a_script(tmp_path):
    cfg = tmp_path / "pdserve.yaml"
    cfg.write_text(yaml.safe_dump({"router": {"port": 6001, "model": str(tmp_path)}}))
    out = subprocess.run(
        [sys.executable, str(REPO / "docker" / "entrypoint.py"), "print-args", "router"],
        capture_output=True,
        text=True,
        env={"PDSERVE_CONFIG": str(cfg), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    argv = json.loads(out.stdout)
    assert argv[1:3] == ["-m", "router"] and argv[argv.index("--port") + 1] == "6001"


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


def test_healthcheck_reports_serving_and_not_serving(health_server, tmp_path, monkeypatch, capsys):
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    monkeypatch.delenv("PDSERVE_TLS_CERT_FILE", raising=False)
    monkeypatch.setenv("PDSERVE_RUN_DIR", str(tmp_path))
    (tmp_path / "health.json").write_text(json.dumps({"role": "router", "port": port}))
    assert healthcheck.main([]) == 0  # port from the entrypoint's health.json
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main(["--port", str(port)]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err


def test_healthcheck_fails_when_nothing_listens(monkeypatch):
    monkeypatch.delenv("PDSERVE_TLS_CERT_FILE", raising=False)
    ok, why = healthcheck.probe("127.0.0.1", 1, timeout=1.0)
    assert not ok and "UNAVAILABLE" in why


def test_openai_role_runs_the_http_front_without_pod_settings():
    """The OpenAI front takes the router address and its port, not the model a shared `common:` names."""
    cfg = {"common": {"model": "/m", "log_level": "INFO"}, "openai": {"port": 8001}}
    s = entrypoint.resolve("openai", cfg, {"PDSERVE_ARG_ROUTER": "router:50051,router-2:50051"})
    assert "model" not in s and s["port"] == 8001 and s["router"] == "router:50051,router-2:50051"
    assert entrypoint.check("openai", s) == 0
    flags = entrypoint.service_flags("openai")
    assert flags is not None and "--http-tls-cert-file" in flags
    argv = entrypoint.command("openai", entrypoint.fit_to_service("openai", s, flags))
    assert argv[1:3] == ["-m", "router.openai_http"] and "--model" not in argv


def test_healthcheck_probes_the_openai_front_over_http(tmp_path, monkeypatch, capsys):
    """Role openai in health.json: GET /health, healthy on 200 only."""
    import http.server
    import threading

    codes = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(codes[0] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv("PDSERVE_HTTP_TLS_CERT_FILE", raising=False)
        monkeypatch.setenv("PDSERVE_RUN_DIR", str(tmp_path))
        (tmp_path / "health.json").write_text(json.dumps({"role": "openai", "port": srv.server_port}))
        assert healthcheck.main([]) == 0
        codes[0] = 503
        assert healthcheck.main([]) == 1
        assert "HTTP 503" in capsys.readouterr().err
    finally:
        srv.shutdown()
    ok, why = healthcheck.probe_http("127.0.0.1", srv.server_port, timeout=1.0)
    assert not ok and "127.0.0.1" in why


@pytest.mark.parametrize("value,want", [("auto", "auto"), (64, 64)])
def test_router_local_prefill_setting_reaches_the_router_parser(value, want):
    """`local_prefill_max_tokens: auto` (or a count) in the router's section of pdserve.yaml (compose, Helm's
    router.config) is a flag the router parses."""
    from pdserve import cli_config
    from router.__main__ import _parser
    from router.config import RouterConfig

    settings = entrypoint.resolve_model(
        entrypoint.resolve("router", {"router": {"local_prefill_max_tokens": value}}, {})
    )
    argv = entrypoint.to_flags(entrypoint.fit_to_service("router", settings, entrypoint.service_flags("router")))
    assert cli_config.from_args(RouterConfig, _parser().parse_args(argv)).local_prefill_max_tokens == want
