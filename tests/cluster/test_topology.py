"""Topology of `pdserve up`: YAML and flags, checked once with pdserve.parallel_config (no process is started)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster.topology import Topology, TopologyError
from pdserve.commands.up import register
from pdserve.parallel_config import ModelParallelInfo

GQA_1KV = ModelParallelInfo(num_attention_heads=8, num_kv_heads=1)
SMOLLM2 = ModelParallelInfo(num_attention_heads=9, num_kv_heads=3)
MHA = ModelParallelInfo(num_attention_heads=8, num_kv_heads=8)


def _ckpt(tmp_path: Path, heads: int = 8, kv: int = 1) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "hidden_size": 64,
            }
        )
    )
    (d / "tokenizer.json").write_text("{}")
    return d


def test_default_topology_has_a_decode_pod_with_dcp():
    t = Topology().resolve(GQA_1KV, cores=2)
    assert [p.name for p in t.prefill] == ["prefill-0"] and [p.name for p in t.decode] == ["decode-0"]
    d = t.decode[0]
    assert (d.tensor_parallel_size, d.decode_context_parallel_size) == (2, 2)
    assert (t.prefill[0].tensor_parallel_size, t.prefill[0].decode_context_parallel_size) == (1, 1)
    assert t.router_port == 50051 and t.http_port == 8000 and t.warnings == []


def test_auto_dcp_for_smollm2_shape_and_mha_fallback():
    t = Topology().resolve(SMOLLM2, cores=16)
    d = t.decode[0]
    assert (d.tensor_parallel_size, d.decode_context_parallel_size) == (9, 3)  # 9 heads, 3 KV heads
    assert t.notes == [
        "decode-0: tp=9 dcp=3, the smallest DCP layout this model allows (9 heads, 3 KV heads); 9 ranks on 16 cores"
    ]
    t = Topology().resolve(MHA)  # MHA allows no DCP > 1: runs without, and says so
    assert (t.decode[0].tensor_parallel_size, t.decode[0].decode_context_parallel_size) == (1, 1)
    assert t.warnings and "allows no DCP > 1" in t.warnings[0]
    # fixed tp, auto dcp / fixed dcp, auto tp
    d = Topology().with_overrides(decode_tp=4).resolve(GQA_1KV).decode[0]
    assert (d.tensor_parallel_size, d.decode_context_parallel_size) == (4, 2)
    d = Topology().with_overrides(decode_dcp=4).resolve(GQA_1KV).decode[0]
    assert (d.tensor_parallel_size, d.decode_context_parallel_size) == (4, 4)


def test_auto_on_fewer_cores_than_the_dcp_ranks_runs_tp1_and_says_how_to_get_dcp():
    t = Topology().resolve(SMOLLM2, cores=2)
    d = t.decode[0]
    assert (d.tensor_parallel_size, d.decode_context_parallel_size) == (1, 1)
    assert t.warnings == [] and len(t.notes) == 1
    assert "needs tp=9, more ranks than this machine's 2 cores" in t.notes[0]
    assert t.notes[0].endswith("pass --decode-tp 9 --decode-dcp 3")
    # Either size given: honoured as asked, whatever the cores.
    d = Topology().with_overrides(decode_dcp=3).resolve(SMOLLM2, cores=2).decode[0]
    assert (d.tensor_parallel_size, d.decode_context_parallel_size) == (9, 3)
    # GPUs: the core count does not apply.
    d = Topology(device="cuda").resolve(SMOLLM2, cores=2).decode[0]
    assert (d.tensor_parallel_size, d.decode_context_parallel_size) == (9, 3)


def test_invalid_parallel_config_is_refused_with_the_rule_and_fix():
    with pytest.raises(TopologyError) as ei:
        Topology().with_overrides(decode_tp=2, decode_dcp=4).resolve(GQA_1KV)
    msg = str(ei.value)
    assert msg.startswith("decode-0 (tp=2 dcp=4)") and "divisible" in msg and "Suggested fix" in msg
    with pytest.raises(TopologyError, match="heads"):
        Topology().with_overrides(prefill_tp=3).resolve(GQA_1KV)
    with pytest.raises(TopologyError, match="decode-only"):
        Topology.from_dict({"prefill": [{"tp": 2, "dcp": 2}]}).resolve(GQA_1KV)


def test_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("""
model: null
host: 127.0.0.1
block_size: 32
max_model_len: 1024
device: cuda
dtype: bfloat16
router: {port: 0, http_port: -1, args: "--max-queue-len 8"}
prefill: {count: 2, tp: 2}
decode:
  - {tp: 4, dcp: 2, interleave: 4, port: 6001, num_kv_blocks: 64}
  - {tp: auto, dcp: auto, args: [--max-num-seqs, 8]}
""")
    t = Topology.from_yaml(f).resolve(GQA_1KV)
    assert t.block_size == 32 and t.max_model_len == 1024 and t.router_port == 0 and t.http_port is None
    assert t.device == "cuda" and t.dtype == "bfloat16"
    assert t.router_args == ["--max-queue-len", "8"]
    assert [(p.name, p.tensor_parallel_size) for p in t.prefill] == [("prefill-0", 2), ("prefill-1", 2)]
    d0, d1 = t.decode
    assert (
        d0.tensor_parallel_size,
        d0.decode_context_parallel_size,
        d0.dcp_kv_cache_interleave_size,
        d0.port,
        d0.num_kv_blocks,
    ) == (4, 2, 4, 6001, 64)
    assert (d1.tensor_parallel_size, d1.decode_context_parallel_size) == (2, 2)
    assert d1.extra_args == ["--max-num-seqs", "8"]
    t.assign_ports()
    ports = [t.router_port, *[p.port for p in t.pods]]
    assert 0 not in ports and len(set(ports)) == len(ports) and 6001 in ports


@pytest.mark.parametrize(
    "text,match",
    [
        ("prefill: [{tp: 1, tpp: 2}]", "unknown key"),
        ("decoder: []", "unknown key"),
        ("prefill: [{tp: two}]", "must be an integer"),
        ("prefill: []", "non-empty list"),
        ("router: {port: 70000}", r"\[0, 65535\]"),
        ("decode: {count: 2, port: 7000}", "cannot be shared"),
        ("- a\n- b", "must be a mapping"),
        ("dtype: fp8", "dtype must be one of auto, float32, bfloat16, float16"),
        ("quantization: int4", "quantization must be one of none, int8, got 'int4'"),
        ("prefill: [{tp: 1", "not valid YAML"),
    ],
)
def test_yaml_errors_name_the_problem(tmp_path, text, match):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(TopologyError, match=match) as ei:
        Topology.from_yaml(f)
    assert str(ei.value).startswith(str(f))


def test_port_clash_and_missing_file():
    with pytest.raises(TopologyError, match="port 7000 is given to both router and prefill-0"):
        Topology.from_dict({"router": {"port": 7000}, "prefill": [{"port": 7000}]}).resolve(GQA_1KV)
    with pytest.raises(TopologyError, match="cannot read topology file"):
        Topology.from_yaml("/nonexistent/cluster.yaml")


def test_flags_override_the_file(tmp_path):
    import argparse

    f = tmp_path / "c.yaml"
    f.write_text("prefill: [{tp: 2}]\ndecode: [{tp: 4, dcp: 4}]\nrouter: {http_port: 9000}\n")
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    register(sub)
    from pdserve.commands.up import topology_from_args

    args = ap.parse_args(
        ["up", "--config", str(f), "--decode-dcp", "2", "--prefill-pods", "2", "--port", "0", "--http-port", "-1"]
    )
    t = topology_from_args(args).resolve(GQA_1KV)
    assert [p.tensor_parallel_size for p in t.prefill] == [2, 2]
    assert (t.decode[0].tensor_parallel_size, t.decode[0].decode_context_parallel_size) == (4, 2)
    assert t.router_port == 0 and t.http_port is None
    with pytest.raises(SystemExit):
        ap.parse_args(["up", "--decode-tp", "zero"])


def test_model_directory_checks(tmp_path):
    with pytest.raises(TopologyError, match="no config.json"):
        Topology(model=str(tmp_path)).resolve()
    d = _ckpt(tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(TopologyError, match="tokenizer.json"):
        Topology(model=str(d)).resolve()


def _dry_run(d, *args: str) -> subprocess.CompletedProcess:
    """`pdserve up --model d --dry-run *args` in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", str(d), "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_up_quantization_reaches_every_pod_and_not_the_router(tmp_path):
    d = _ckpt(tmp_path, heads=8, kv=1)
    out = _dry_run(d, "--quantization", "int8")
    assert out.returncode == 0, out.stderr
    for argv in json.loads(out.stdout)["commands"].values():
        assert ("--quantization" in argv) == (argv[2] in ("prefill_svc", "decode_svc"))
        assert "--quantization" not in argv or argv[argv.index("--quantization") + 1] == "int8"


@pytest.mark.parametrize(
    "router_args,profiles",
    [
        ([], False),
        (["--local-prefill-max-tokens", "64"], False),
        (["--local-prefill-max-tokens", "auto"], True),
        (["--local-prefill-max-tokens=AUTO"], True),  # as the router reads it
    ],
)
def test_pods_time_their_step_profile_only_for_a_router_on_auto(tmp_path, router_args, profiles):
    from pdserve.cluster.supervisor import LocalCluster

    t = Topology.from_dict({"router": {"args": router_args}, "decode": [{"tp": 1, "dcp": 1}]}).resolve(GQA_1KV)
    t.assign_ports()
    for s in LocalCluster(t, log_dir=tmp_path)._plan():
        if s.kind in ("prefill", "decode"):
            assert ("--no-step-profile" in s.argv) != profiles, s.name


@pytest.mark.slow
def test_up_dry_run_prints_the_checked_plan(tmp_path):
    d = _ckpt(tmp_path, heads=8, kv=1)
    out = _dry_run(d, "--port", "0", "--http-port", "0")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    dec = [p for p in plan["pods"] if p["role"] == "decode"][0]
    assert (dec["tp"], dec["dcp"]) == (2, 2)
    cmd = plan["commands"]["decode-0"]
    assert cmd[1:3] == ["-m", "decode_svc"] and "--decode-context-parallel-size" in cmd
    assert plan["commands"]["prefill-0"][cmd.index("-m") + 1] == "prefill_svc"
    assert "--router" in plan["commands"]["prefill-0"] and "--device" not in cmd
    assert "--router" in cmd  # decode pods register with the router too
    assert "--dtype" not in cmd  # auto unless asked
    bf16 = _dry_run(d, "--dtype", "bfloat16")
    assert bf16.returncode == 0, bf16.stderr
    for argv in json.loads(bf16.stdout)["commands"].values():  # the same dtype on every pod, none on the router
        assert ("--dtype" in argv) == (argv[2] in ("prefill_svc", "decode_svc"))
        assert "--dtype" not in argv or argv[argv.index("--dtype") + 1] == "bfloat16"
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            str(d),
            "--dry-run",
            "--decode-tp",
            "2",
            "--decode-dcp",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "Suggested fix" in bad.stderr and bad.stdout == ""


def test_a_cluster_without_one_role_is_refused_unless_asked_for():
    """A cluster must generate, so it needs both roles; a one-role cluster (a service tested alone) is allowed only
    when asked for, and never an empty one."""
    with pytest.raises(TopologyError, match="at least one decode pod"):
        Topology(decode=[]).resolve(GQA_1KV, cores=2)
    with pytest.raises(TopologyError, match="at least one prefill pod"):
        Topology(prefill=[]).resolve(GQA_1KV, cores=2)
    t = Topology(decode=[]).resolve(GQA_1KV, cores=2, one_role=True)
    assert [p.name for p in t.pods] == ["prefill-0"]
    with pytest.raises(TopologyError, match="at least one prefill pod"):
        Topology(prefill=[], decode=[]).resolve(GQA_1KV, cores=2, one_role=True)


def test_assigned_ports_keep_clear_of_ports_named_in_service_args(monkeypatch):
    """A --metrics-port given to a pod or the router binds only once that service runs, so assign_ports must not
    hand the same number to another service meanwhile."""
    import pdserve.cluster.topology as topology

    named = {"--metrics-port": 41001, "--http-metrics-port": 41002, "--metrics-port=": 41003}
    picks = iter([41001, 41002, 41003, 41004, 41005, 41006, 41007, 41008, 41009])
    monkeypatch.setattr(topology, "free_port", lambda host, avoid: next(p for p in picks if p not in avoid))
    t = Topology.from_dict(
        {
            "router": {"port": 0, "http_port": 0, "args": ["--metrics-port", str(named["--metrics-port"])]},
            "prefill": [{"port": 0, "args": ["--http-metrics-port", str(named["--http-metrics-port"])]}],
            "decode": [{"port": 0, "tp": 1, "dcp": 1, "args": [f"--metrics-port={named['--metrics-port=']}"]}],
        }
    )
    t.assign_ports()
    assigned = {t.router_port, t.http_port, *[p.port for p in t.pods]}
    assert assigned == {41004, 41005, 41006, 41007}
    assert topology._ports_in_args(["--metrics-port", "0", "--port", "x", "--max-num-seqs", "8"]) == set()


def test_several_routers_from_yaml_and_flags(tmp_path, monkeypatch):
    f = tmp_path / "t.yaml"
    f.write_text("router: {ports: [50070, 0, 50072]}\n")
    t = Topology.from_yaml(f)
    assert t.num_routers == 3 and t.router_port == 50070 and t.router_ports == [50070, 0, 50072]
    t.assign_ports()
    assert len(set(t.router_ports)) == 3 and 0 not in t.router_ports
    assert Topology.from_dict({"router": {"count": 2}}).router_ports == [50051, 0]
    for bad, match in [
        ({"count": 0}, "router.count"),
        ({"count": 2, "ports": [1, 2, 3]}, "router.count"),
        ({"ports": []}, "router.ports"),
        ({"port": 5, "ports": [6]}, "router.port"),
    ]:
        with pytest.raises(TopologyError, match=match):
            Topology.from_dict({"router": bad})
    with pytest.raises(TopologyError, match="given to both router and router-1"):
        Topology.from_dict({"router": {"ports": [50070, 50070]}}).resolve(GQA_1KV, cores=2)
    assert Topology().with_overrides(num_routers=2).num_routers == 2
    with pytest.raises(TopologyError, match="--routers"):
        Topology().with_overrides(num_routers=0)


@pytest.mark.slow
def test_up_dry_run_points_every_pod_at_every_router(tmp_path):
    d = _ckpt(tmp_path, heads=8, kv=1)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            str(d),
            "--dry-run",
            "--routers",
            "2",
            "--port",
            "0",
            "--http-port",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert len(plan["routers"]) == 2 and plan["router"] == plan["routers"][0]
    assert {"router", "router-1"} <= set(plan["commands"])
    for pod in ("prefill-0", "decode-0"):
        argv = plan["commands"][pod]
        assert argv[argv.index("--router") + 1] == ",".join(plan["routers"])
