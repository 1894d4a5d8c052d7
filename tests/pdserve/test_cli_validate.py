"""Tests for `pdserve validate` (pdserve/commands/validate.py).

Messages are vLLM's (see tests/pdserve/test_parallel_config.py for where each one came from).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.commands import validate as validate_cmd
from pdserve.commands.validate import main_validate, register

REPO_ROOT = Path(__file__).resolve().parents[2]

SEED_MSG = (
    "Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (8) to be greater than the model's "
    "total number of KV heads (8). Increase `--tensor-parallel-size` or set `--decode-context-parallel-size 1`."
)


@pytest.fixture
def llama_dir(tmp_path):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_valid_config_exit_0_one_line(llama_dir, capsys):
    rc = main_validate(
        ["--model", str(llama_dir), "--tensor-parallel-size", "16", "--decode-context-parallel-size", "2"]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert err == ""
    assert out.count("\n") == 1 and out.startswith("valid: tensor_parallel_size=16 decode_context_parallel_size=2")


def test_refused_config_exit_2_message_and_fix_on_stderr(llama_dir, capsys):
    rc = main_validate(
        ["--model", str(llama_dir), "--tensor-parallel-size", "8", "--decode-context-parallel-size", "2"]
    )
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert SEED_MSG in err
    assert "--tensor-parallel-size 16" in err
    lines = err.strip().splitlines()
    assert lines[0] == f"invalid parallel config: {SEED_MSG}"
    assert lines[1].startswith("fix: Use `--tensor-parallel-size 16`")


def test_head_counts_instead_of_model(capsys):
    assert main_validate(["--num-attention-heads", "32", "--num-kv-heads", "8", "-tp", "16", "-dcp", "4"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the maximum supported value (2)" in err
    assert "--decode-context-parallel-size 2" in err
    # MHA by default when --num-kv-heads is missing: DCP is impossible, fix is DCP 1.
    assert main_validate(["--num-attention-heads", "32", "-tp", "8", "-dcp", "2"]) == 2
    assert "--decode-context-parallel-size 1" in capsys.readouterr().err
    # MLA: only TP % DCP applies.
    assert main_validate(["--num-attention-heads", "16", "--use-mla", "-tp", "8", "-dcp", "8"]) == 0
    # Sliding window refuses DCP.
    assert (
        main_validate(
            ["--num-attention-heads", "32", "--num-kv-heads", "8", "--sliding-window", "4096", "-tp", "16", "-dcp", "2"]
        )
        == 2
    )
    assert "DCP not support sliding window." in capsys.readouterr().err


def test_other_flags(capsys):
    rc = main_validate(
        [
            "--num-attention-heads",
            "32",
            "--num-kv-heads",
            "8",
            "-tp",
            "16",
            "-dcp",
            "2",
            "--dcp-kv-cache-interleave-size",
            "32",
            "--block-size",
            "16",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "Block_size(16) should be greater than or equal to and divisible by cp_kv_cache_interleave_size (32)." in err
    assert "--dcp-kv-cache-interleave-size 16" in err
    assert main_validate(["--num-attention-heads", "32", "--pipeline-parallel-size", "0"]) == 2
    assert "`--pipeline-parallel-size` must be a positive integer (>= 1), got 0." in capsys.readouterr().err
    assert main_validate(["--num-attention-heads", "32", "-pp", "4", "--block-size", "32"]) == 0


def test_json_output(capsys):
    rc = main_validate(["--num-attention-heads", "32", "--num-kv-heads", "8", "-tp", "8", "-dcp", "2", "--json"])
    assert rc == 2
    data = json.loads(capsys.readouterr().out)
    assert data["valid"] is False and data["rule"] == "dcp_tp_gt_kv_heads"
    assert data["message"] == SEED_MSG
    assert data["fix"]["flag"] == "--tensor-parallel-size" and data["fix"]["value"] == 16
    assert data["fix"]["changes"] == {"--tensor-parallel-size": 16}
    assert (
        main_validate(["--num-attention-heads", "32", "--num-kv-heads", "8", "-tp", "16", "-dcp", "2", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out) == {
        "valid": True,
        "rule": None,
        "message": (
            "valid: tensor_parallel_size=16 decode_context_parallel_size=2 pipeline_parallel_size=1 "
            "dcp_kv_cache_interleave_size=1 block_size=16 for a GQA model with 32 attention heads and 8 KV heads"
        ),
        "fix": None,
    }


def test_bad_input_exit_1(tmp_path, capsys):
    assert main_validate(["--model", str(tmp_path / "nope"), "-tp", "2"]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert main_validate(["-tp", "2"]) == 1
    assert "--model or --num-attention-heads" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert main_validate(["--model", str(tmp_path)]) == 1
    assert main_validate(["--num-attention-heads", "32", "--num-kv-heads", "6"]) == 1  # 32 % 6 != 0
    assert main_validate(["--model", str(tmp_path), "--num-attention-heads", "8"]) == 1
    assert "not both" in capsys.readouterr().err


def test_register_adds_validate_subcommand(capsys):
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    args = parser.parse_args(
        [
            "validate",
            "--num-attention-heads",
            "32",
            "--num-kv-heads",
            "8",
            "--tensor-parallel-size",
            "8",
            "--decode-context-parallel-size",
            "2",
        ]
    )
    assert args.command == "validate"
    assert args.func is validate_cmd.run_validate
    assert args.func(args) == 2
    assert SEED_MSG in capsys.readouterr().err


def test_python_dash_m_entry_point():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.commands.validate",
            "--num-attention-heads",
            "32",
            "--num-kv-heads",
            "8",
            "--tensor-parallel-size",
            "8",
            "--decode-context-parallel-size",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(REPO_ROOT),
        timeout=120,
    )
    assert proc.returncode == 2
    assert SEED_MSG in proc.stderr
    assert "--tensor-parallel-size 16" in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.commands.validate",
            "--num-attention-heads",
            "32",
            "--num-kv-heads",
            "8",
            "-tp",
            "16",
            "-dcp",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(REPO_ROOT),
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("valid: ")
