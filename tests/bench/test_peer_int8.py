"""`pdserve bench peer`'s int8 rows without timing anything: the W8A8 checkpoint both sides load (read back by
pdserve and by compressed-tensors itself), vLLM's real failure turned into the reason the rows carry, and the rows and
ratios with and without a vLLM side."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

import bench.peer as peer
from bench.common import format_table
from pdserve.model import quant
from pdserve.model.config import ModelConfig

_MEDIANS = {
    "prefill": {"pdserve": 900.0, "pdserve_q8_0": 800.0, "vllm": 600.0},
    "decode_bs1": {"pdserve": 40.0, "pdserve_q8_0": 50.0, "vllm": 20.0},
}


def _venv_python():
    python = peer.vllm_venv() / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no vLLM venv at {peer.vllm_venv()} (pdserve bench peer makes it)")
    return python


def test_int8_rows_name_their_ratios_like_the_fp32_ones():
    rows, ratios = peer._rows(_MEDIANS, peer.INT8_SIDES)
    assert ratios == {
        "prefill256_int8_vs_vllm": 1.5,
        "decode_bs1_int8_vs_vllm": 2.0,
        "prefill256_int8_q8_0_vs_vllm": 800.0 / 600.0,
        "decode_bs1_int8_q8_0_vs_vllm": 2.5,
    }
    assert [(r["workload"], r["dtype"]) for r in rows] == [
        ("prefill256", "int8"),
        ("decode_bs1", "int8"),
        ("prefill256", "int8_q8_0"),
        ("decode_bs1", "int8_q8_0"),
    ]
    assert rows[3]["pdserve tok/s"] == 50.0 and rows[3]["vllm tok/s"] == 20.0
    fp32_rows, fp32_ratios = peer._rows(
        {w: {"pdserve": p["pdserve"], "vllm": p["vllm"]} for w, p in _MEDIANS.items()}, {"pdserve": "fp32"}
    )
    assert set(fp32_ratios) == {"prefill256_fp32_vs_vllm", "decode_bs1_fp32_vs_vllm"}
    assert [r["dtype"] for r in fp32_rows] == ["fp32", "fp32"]


def test_an_unavailable_vllm_leaves_its_cells_saying_why_and_no_ratio():
    why = "vLLM exited with 1: RuntimeError: no int8 kernel (log: vllm.log)"
    pdserve_only = {w: {s: v for s, v in per.items() if s != "vllm"} for w, per in _MEDIANS.items()}
    rows, ratios = peer._rows(pdserve_only, peer.INT8_SIDES, vllm_unavailable=why)
    assert ratios == {}
    assert len(rows) == 4
    for row in rows:
        assert row["vllm tok/s"] == f"unavailable: {why}"
        assert row["ratio (target >= 1.1)"] == ""
    assert [r["pdserve tok/s"] for r in rows] == [900.0, 40.0, 800.0, 50.0]
    table = format_table(rows)
    assert table.count(f"unavailable: {why}") == 4
    assert json.loads(json.dumps(rows)) == rows


def test_root_cause_is_the_first_exception_vllm_logged():
    # Lines as vLLM 0.32's CPU build logged a failed start here: the worker's own error comes before the ones of
    # the processes waiting on it.
    log = "\n".join(
        [
            "(Worker pid=3124) INFO 12-07 21:32:44 [cpu_model_runner.py:68] Starting to load model /m...",
            "(Worker pid=3124) ERROR 12-07 21:32:45 [multiproc_executor.py:801] WorkerProc failed to start.",
            "(Worker pid=3124) ERROR 12-07 21:32:45 [multiproc_executor.py:953] Traceback (most recent call last):",
            '(Worker pid=3124) ERROR 12-07 21:32:45 [multiproc_executor.py:953]   File "/v/loader.py", line 53',
            "(Worker pid=3124) ERROR 12-07 21:32:45 [multiproc_executor.py:953] NotImplementedError: No scheme for x",
            "(EngineCore pid=3106) ERROR 12-07 21:32:46 [core.py:1510] Exception: WorkerProc initialization failed due "
            "to an exception in a background process. See stack trace for root cause.",
            "Traceback (most recent call last):",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        ]
    )
    assert peer.root_cause(log) == "NotImplementedError: No scheme for x"
    # a message that starts on the line after the exception's name
    assert peer.root_cause("RuntimeError: \n        An attempt has been made\n") == (
        "RuntimeError: An attempt has been made"
    )
    assert peer.root_cause("INFO all well\n/x.py:3: UserWarning: not an exception line\n") is None


def test_w8a8_checkpoint_is_written_once_and_loads_as_int8_in_pdserve(tiny_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    src = tiny_factory("llama")
    ct = peer.w8a8_checkpoint(src)
    assert ct.parent == tmp_path / "peer" and not list(ct.parent.glob("*.partial"))
    assert quant.checkpoint_int8(ModelConfig.from_path(ct))
    stamp = (ct / "model.safetensors").stat().st_mtime_ns
    assert peer.w8a8_checkpoint(src) == ct
    assert (ct / "model.safetensors").stat().st_mtime_ns == stamp


_CT_CHECK = """
import json, sys
import torch
from safetensors.torch import load_file
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig

src, ct = sys.argv[1], sys.argv[2]
qc = QuantizationConfig.model_validate(json.load(open(ct + "/config.json"))["quantization_config"])
(scheme,) = qc.config_groups.values()
comp = BaseCompressor.load_from_registry(qc.format)
full, ours = load_file(src + "/model.safetensors"), load_file(ct + "/model.safetensors")
layers = {}
for key, w in full.items():
    if key + "_scale" not in ours:
        assert torch.equal(ours[key], w), key  # not quantised: as it was
        continue
    layer = key[: -len(".weight")]
    names = comp.compression_param_names(scheme)
    state = {"weight": w, "weight_scale": ours[key + "_scale"]}
    theirs = comp.compress(state, scheme)
    assert set(theirs) == set(names), (set(theirs), names)
    assert theirs["weight"].dtype == torch.int8 and torch.equal(theirs["weight"], ours[key]), key
    back = comp.decompress({"weight": ours[key], "weight_scale": ours[key + "_scale"]}, scheme)["weight"]
    assert ((back - w).abs() <= ours[key + "_scale"] / 2 + 1e-6).all(), key
    layers[layer.rsplit(".", 1)[1]] = 1
print(json.dumps({
    "format": qc.format, "compressor": type(comp).__name__, "weights": scheme.weights.strategy,
    "activations": [scheme.input_activations.strategy, scheme.input_activations.dynamic], "ignore": qc.ignore,
    "linears": sorted(layers),
}))
"""


@pytest.mark.slow  # compressed-tensors and torch imported in vLLM's venv
def test_compressed_tensors_reads_the_checkpoint_as_w8a8_with_the_same_int8_weights(tiny_factory, tmp_path):
    python = _venv_python()
    src = tiny_factory("llama")
    ct = peer.write_w8a8_checkpoint(src, tmp_path / "w8a8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), "-c", _CT_CHECK, str(src), str(ct)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {
        "format": "int-quantized",
        "compressor": "IntQuantizationCompressor",
        "weights": "channel",
        "activations": ["token", True],
        "ignore": ["lm_head"],
        "linears": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
    }


@pytest.mark.slow  # starts vLLM up to its weight loading (about a minute)
def test_a_w8a8_checkpoint_vllm_cannot_load_gives_vllms_own_reason(tiny_factory, tmp_path, monkeypatch):
    python = _venv_python()
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def recording(*args, **kw):
        started.append(popen(*args, **kw))
        return started[-1]

    monkeypatch.setattr(peer.subprocess, "Popen", recording)
    ct = peer.write_w8a8_checkpoint(tiny_factory("llama"), tmp_path / "w8a8")
    cfg = json.loads((ct / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False  # no W8A8 scheme of vLLM's
    (ct / "config.json").write_text(json.dumps(cfg))
    try:
        side = peer.VLLMSide(python, str(ct), peer.INT8_DTYPE, 1, tmp_path / "vllm.log", start_timeout_s=600)
    except peer.PeerUnavailable as e:
        msg = str(e)
    else:
        side.close()
        pytest.fail("vLLM started on a checkpoint with asymmetric int8 weights")
    cause = peer.root_cause((tmp_path / "vllm.log").read_text())
    assert msg.startswith("vLLM exited with ") and cause is not None and f": {cause} (log: " in msg
    assert cause.startswith("NotImplementedError: No compressed-tensors compatible scheme"), cause
    assert "Engine core initialization failed" not in cause
    # the worker's whole process group is gone (once init has reaped the killed members): no engine core or worker
    # left polling on the cores
    (proc,) = started
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"vLLM's process group {proc.pid} outlived its failed start")
