"""pdserve.cli_config: every config field is a flag, the same on every service, and a config survives
config -> argv -> config."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from decode_svc.config import DecodeConfig
from pdserve import cli_config
from pdserve.engine.config import EngineConfig
from pdserve.pod.config import PodServing
from prefill_svc.config import PrefillConfig
from router.config import OpenAIHttpConfig, RouterConfig

POD_CLASSES = (PrefillConfig, DecodeConfig)


def _parse(cls, argv, environ=None):
    p = cli_config.build_parser(cls, "test", environ={} if environ is None else environ)
    return p.parse_args(argv)


@pytest.mark.parametrize(
    "cfg",
    [
        PrefillConfig(),
        cli_config.build(
            PrefillConfig,
            tensor_parallel_size=2,
            enable_prefix_caching=False,
            exact_prefill=True,
            metrics_port=0,
            drain_timeout_s=2.5,
            router_address="r:1",
            kv_transport="tcp",
            attention_backend="torch",
            lease_ttl_s=0.125,
        ),
        RouterConfig(port=0, metrics_port=9100, drain_timeout_s=1.5, event_loop="asyncio", lease_ttl_s=3.0),
        OpenAIHttpConfig(router="h:1", port=0),
    ],
    ids=["prefill-defaults", "prefill", "router", "openai-http"],
)
def test_round_trip_config_argv_config(cfg):
    argv = cli_config.to_argv(cfg)
    assert cli_config.from_args(type(cfg), _parse(type(cfg), argv)) == cfg
    assert cli_config.from_args(type(cfg), _parse(type(cfg), cli_config.to_argv(cfg, all_fields=True))) == cfg


def test_nested_defaults_come_from_the_holders_factory():
    """DecodeConfig's engine and serving defaults are its own (default_factory), on the command line too."""
    ns = _parse(DecodeConfig, [])
    d, p = DecodeConfig.__dataclass_fields__, _parse(PrefillConfig, [])
    assert (ns.max_num_seqs, ns.enable_prefix_caching, ns.port, ns.pod_id, ns.drain_timeout_s) == (
        256,
        False,
        50061,
        "decode-0",
        120.0,
    )
    assert (p.max_num_seqs, p.enable_prefix_caching, p.port, p.pod_id, p.drain_timeout_s) == (64, True, 0, None, 60.0)
    assert d["engine"].default_factory().max_num_seqs == 256
    # build() fills what it is not told from the same defaults
    assert cli_config.build(PrefillConfig, block_size=32).engine == dataclasses.replace(EngineConfig(), block_size=32)


def test_every_engine_and_serving_field_is_a_flag_of_both_pods():
    """A field added to EngineConfig (or PodServing) is a flag of every pod with nothing else to change."""
    shared = {f.name for f in dataclasses.fields(EngineConfig)} | {f.name for f in dataclasses.fields(PodServing)}
    for cls in POD_CLASSES:
        assert shared <= set(cli_config.field_names(cls)), cls
    assert cli_config.flags_of(EngineConfig) | cli_config.flags_of(PodServing) <= cli_config.flags_of(
        PrefillConfig
    ) & cli_config.flags_of(DecodeConfig)


@pytest.mark.parametrize("module", ["prefill_svc", "decode_svc", "router", "router.openai_http"])
def test_help_of_every_service_lists_the_shared_flags(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    common = [
        "--host",
        "--port",
        "--log-level",
        "--tls-ca-file",
        "--tls-cert-file",
        "--tls-key-file",
        "--tls-server-name",
    ]
    servers = [
        "--metrics-port",
        "--drain-timeout-s",
        "--cluster-token",
        "--heartbeat-interval-s",
        "--tls-require-client-cert",
        "--served-model-name",
        "--model",
    ]
    pods = [
        "--router",
        "--pod-id",
        "--advertise-host",
        "-tp",
        "-dcp",
        "--tensor-parallel-size",
        "--block-size",
        "--num-kv-blocks",
        "--max-num-seqs",
        "--exact-prefill",
        "--cpu-collectives",
        "--no-prefix-caching",
    ]
    want = (
        common
        + (servers if module != "router.openai_http" else ["--router", "--api-key"])
        + (pods if module.endswith("_svc") else [])
    )
    missing = [
        f
        for f in want
        if f not in out.stdout.split() and not any(w.startswith(f + ",") or w == f"[{f}" for w in out.stdout.split())
    ]
    assert not missing, (module, missing)


def test_bad_values_get_argparse_errors_naming_the_flag(capsys):
    for argv, needle in [
        (["--port", "x"], "argument --port: invalid int value: 'x'"),
        (["--lease-ttl-s", "soon"], "argument --lease-ttl-s: invalid float value: 'soon'"),
        (["--kv-transport", "pigeon"], "argument --kv-transport: invalid choice: 'pigeon'"),
        (["--drain-timeout", "3"], "unrecognized arguments: --drain-timeout"),
    ]:
        with pytest.raises(SystemExit) as ei:
            _parse(PrefillConfig, argv)
        assert ei.value.code == 2
        assert needle in capsys.readouterr().err, argv


def test_config_validation_errors_reach_main_with_status_2(capsys):
    from prefill_svc.__main__ import main

    assert main(["--metrics-port", "70000"]) == 2
    assert "metrics_port must be a port number" in capsys.readouterr().err


def test_optional_values_bools_and_aliases():
    ns = _parse(
        PrefillConfig,
        ["--metrics-port", "none", "-tp", "3", "--no-exact-prefill", "--prefix-caching", "--router-address", "r:2"],
    )
    assert (
        ns.metrics_port,
        ns.tensor_parallel_size,
        ns.exact_prefill,
        ns.enable_prefix_caching,
        ns.router_address,
    ) == (None, 3, False, True, "r:2")
    assert _parse(PrefillConfig, ["--metrics-port", "0"]).metrics_port == 0  # 0: any free port, not "off"


def test_env_defaults_and_secrets():
    env = {"PDSERVE_CLUSTER_TOKEN": "s3cret", "PDSERVE_TLS_REQUIRE_CLIENT_CERT": "yes"}
    ns = _parse(DecodeConfig, [], env)
    assert ns.cluster_token == "s3cret" and ns.tls_require_client_cert is True
    p = cli_config.build_parser(RouterConfig, "router", environ={"PDSERVE_API_KEY": "k3y"})
    assert "k3y" not in p.format_help() and "PDSERVE_API_KEY" in p.format_help()
    cfg = RouterConfig(api_key="k3y", cluster_token="t")
    assert "k3y" not in cli_config.to_argv(cfg) and "--api-key" not in cli_config.to_argv(cfg)
    assert cli_config.to_argv(cfg, secrets=True)[-4:] == ["--cluster-token", "t", "--api-key", "k3y"]


def test_argv_for_refuses_names_the_config_does_not_have():
    assert cli_config.argv_for(DecodeConfig, router_address="r:1", enable_prefix_caching=True, drain_timeout_s=2) == [
        "--router",
        "r:1",
        "--enable-prefix-caching",
        "--drain-timeout-s",
        "2",
    ]
    with pytest.raises(KeyError, match="drain_grace_s"):
        cli_config.argv_for(RouterConfig, drain_grace_s=1.0)
    with pytest.raises(TypeError, match="no field 'bogus'"):
        cli_config.build(PrefillConfig, bogus=1)
