"""`pdserve up` with the real services, in a subprocess: whatever happens during startup (a service that dies, a
Ctrl-C before the cluster is ready), it exits and no process it started survives. The ready-cluster checks (SDK,
OpenAI client, Ctrl-C after serving) are in tests/client/test_live_cluster.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from up_helpers import UpProcess

pytestmark = pytest.mark.slow  # pdserve up in a subprocess per test


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    # 1 KV head: TP 2 x DCP 2 is valid; the full SmolLM2 vocabulary so text prompts and the chat template work.
    return tiny_factory("llama", num_heads=8, num_kv_heads=1, vocab_size=49152)


def test_a_service_that_dies_at_startup_fails_up_and_stops_the_rest(tmp_path, tiny):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("router: {args: [--no-such-flag]}\n")
    up = UpProcess(
        ["--config", str(cfg), "--model", str(tiny), "--port", "0", "--http-port", "0", "--num-kv-blocks", "64"],
        log_dir=tmp_path / "logs",
        startup_timeout=300,
    )
    up.start(wait=False)
    try:
        rc = up.proc.wait(300)
        out = up.output.read_text()
        assert rc == 1, up.tail()
        assert "router exited with status 2" in out and "--no-such-flag" in out
        assert "all processes stopped" in out
        assert "did not stop" not in out and "killing" not in out  # every service stopped by itself
        assert up.wait_all_gone(10) == []
    finally:
        up.kill()


def test_ctrl_c_during_startup_stops_everything(tmp_path, tiny):
    up = UpProcess(
        ["--model", str(tiny), "--port", "0", "--http-port", "0", "--num-kv-blocks", "64"],
        log_dir=tmp_path / "logs",
        startup_timeout=300,
    )
    up.start(wait=False)
    try:
        # wait until the services (and the decode pod's second TP rank) are running, then Ctrl-C; a fresh machine
        # builds the CPU kernels in the pods' first start, so allow the whole startup budget
        end = time.monotonic() + up.startup_timeout
        while len(up.descendants()) < 6 and time.monotonic() < end and up.proc.poll() is None:
            time.sleep(0.2)
        assert len(up.descendants()) >= 6, up.tail()
        t = time.monotonic()
        rc = up.interrupt(timeout=120)
        assert rc == 0, up.tail()
        assert time.monotonic() - t < 60
        left = up.wait_all_gone(10)
        assert left == [], left
        assert "stopping the cluster" in up.output.read_text()
    finally:
        up.kill()


def test_ask_answers_then_stops_everything(tmp_path, tiny):
    """`pdserve up --ask PROMPT` (what scripts/run.sh runs): up, one streamed chat answer, everything stopped."""
    up = UpProcess(
        [
            "--model",
            str(tiny),
            "--port",
            "0",
            "--http-port",
            "0",
            "--num-kv-blocks",
            "64",
            "--ask",
            "What is the capital of France?",
            "--ask-max-tokens",
            "5",
        ],
        log_dir=tmp_path / "logs",
        startup_timeout=300,
    )
    up.start(wait=False)
    try:
        while up.proc.poll() is None:
            up.descendants()
            time.sleep(0.2)
        out = up.output.read_text()
        assert up.proc.returncode == 0, up.tail()
        assert "> What is the capital of France?" in out and "5 completion tokens" in out
        assert "all processes stopped" in out
        assert "did not stop" not in out and "killing" not in out  # every drained pod exited by itself
        assert up.wait_all_gone(10) == []
    finally:
        up.kill()


def test_sigkilled_up_takes_every_service_with_it(tmp_path, tiny):
    """`pdserve up` killed with SIGKILL (no chance to clean up): its services and their TP ranks still die."""
    up = UpProcess(
        ["--model", str(tiny), "--port", "0", "--http-port", "0", "--num-kv-blocks", "64"],
        log_dir=tmp_path / "logs",
        startup_timeout=300,
    )
    try:
        up.start()
        assert len(up.descendants()) >= 6
        up.proc.kill()
        up.proc.wait(10)
        left = up.wait_all_gone(20)
        assert left == [], left
    finally:
        up.kill()


def test_up_process_dies_with_the_test_that_started_it(tmp_path, tiny):
    """UpProcess (the harness of these tests): a killed test run does not leave `pdserve up` and its cluster."""
    import subprocess
    import sys

    import psutil

    tests_dir = str(Path(__file__).resolve().parents[1])  # where up_helpers lives
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import sys
import time
sys.path.insert(0, {tests_dir!r})
from up_helpers import UpProcess
up = UpProcess(["--model", {str(tiny)!r}, "--port", "0", "--http-port", "0", "--num-kv-blocks", "64"],
               log_dir={str(tmp_path / "logs")!r})
up.start(wait=False)
print(up.proc.pid, flush=True)
time.sleep(600)
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    up_pid = int(driver.stdout.readline())
    up_proc = psutil.Process(up_pid)
    seen: dict[int, psutil.Process] = {}
    end = time.monotonic() + 120
    while len(seen) < 6 and time.monotonic() < end:
        for k in up_proc.children(recursive=True):
            seen.setdefault(k.pid, k)
        time.sleep(0.2)
    driver.kill()
    driver.wait(10)
    gone, alive = psutil.wait_procs([up_proc, *seen.values()], timeout=60)
    assert alive == [], [p.cmdline() for p in alive]
