"""llama.cpp for `pdserve bench llamacpp`: builds its C++ `llama-server` once per version and CPU, converts the
default model to GGUF at each precision, and starts the server.

The source is the llama.cpp tree that the llama-cpp-python sdist vendors (PyPI is the one registry reached here).
Everything lands under the pdserve cache, keyed by that version and the CPU's SIMD flags (GGML_NATIVE tunes the build
to the CPU that compiled it), behind a file lock so two runs never build or convert at once."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import BenchUnavailable, cpu_info
from pdserve.default_model import cache_dir

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",  # the server loads local files only; no libcurl needed
)
BUILD_JOBS = 2
# The converter's imports beyond this environment's (its Llama path asks sentencepiece before reading tokenizer.json),
# installed into the cache beside the build rather than into the environment pdserve runs in.
CONVERTER_DEPS = ("sentencepiece>=0.2,<0.3",)
# GGUF outtype of convert_hf_to_gguf.py for each pdserve precision it is compared with.
GGUF_TYPES = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0"}


class LlamaCppUnavailable(BenchUnavailable):
    """llama.cpp could not be fetched, built, converted or started here; the message says why."""


def build_key(version: str, flags: list[str]) -> str:
    """Cache directory name: a build made for one CPU's flags is not reused on another (GGML_NATIVE)."""
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    return f"llamacpp-{version}-{digest}"


def home() -> Path:
    return cache_dir() / "peer" / build_key(LLAMA_CPP_PYTHON, cpu_info()["flags"])


def _run(cmd: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-8:]
        raise LlamaCppUnavailable(
            f"{' '.join(cmd[:4])} exited {done.returncode}:\n  " + "\n  ".join(tail) + f"\n(full log: {log})"
        )


class _Lock:
    """One builder per cache directory; the others wait and then find its result."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("w")

    def __enter__(self) -> _Lock:
        fcntl.flock(self._f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()


def source_dir(root: Path) -> Path:
    """The vendored llama.cpp tree, unpacked from the sdist on first use."""
    src = root / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    with _Lock(root / "src.lock"):
        return _unpack(root, src)


def _unpack(root: Path, src: Path) -> Path:
    if (src / "CMakeLists.txt").is_file():
        return src
    dl = root / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    log = root / "fetch.log"
    tarballs = list(dl.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
    if not tarballs:
        pkg = f"llama-cpp-python=={LLAMA_CPP_PYTHON}"
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", pkg, "-d", str(dl)], log)
        tarballs = list(dl.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
    if not tarballs:
        raise LlamaCppUnavailable(f"pip downloaded no llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz into {dl}")
    shutil.rmtree(root / "src", ignore_errors=True)
    with tarfile.open(tarballs[0]) as tar:
        tar.extractall(root / "src", filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise LlamaCppUnavailable(f"the sdist has no vendor/llama.cpp tree at {src}")
    return src


def ensure_server() -> Path:
    """Path of the built `llama-server`, building it first on a machine that has none (tens of minutes on 2 cores)."""
    root = home()
    binary = root / "bin" / "llama-server"
    if binary.is_file():
        return binary
    with _Lock(root / "build.lock"):
        if binary.is_file():
            return binary
        root.mkdir(parents=True, exist_ok=True)
        src = source_dir(root)
        build = root / "build"
        log = root / "build.log"
        print(f"building llama-server {LLAMA_CPP_PYTHON} into {root} (first use; long)", file=sys.stderr, flush=True)
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        _run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], log)
        _run([*nice, "cmake", "--build", str(build), "--target", "llama-server", f"-j{BUILD_JOBS}"], log)
        built = next((p for p in (build / "bin" / "llama-server", build / "llama-server") if p.is_file()), None)
        if built is None:
            raise LlamaCppUnavailable(f"the build finished without a llama-server binary (log: {log})")
        (root / "bin").mkdir(exist_ok=True)
        tmp = binary.with_suffix(".tmp")
        shutil.copy2(built, tmp)
        tmp.replace(binary)  # whole or absent: a half-copied binary would pass is_file()
    return binary


def converter_env(src: Path, deps: Path) -> dict[str, str]:
    """The converter imports `gguf` from its own tree (the PyPI release may lag the architectures it knows) and its
    other missing modules from ``deps``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src / "gguf-py"), str(deps), env.get("PYTHONPATH", "")]))
    return env


def _converter_deps(root: Path) -> Path:
    deps = root / "pydeps"
    if not (deps / ".done").is_file():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(deps), *CONVERTER_DEPS]
        _run(pip, root / "convert.log")
        (deps / ".done").write_text(" ".join(CONVERTER_DEPS))
    return deps


def ensure_gguf(model_dir: Path, precision: str) -> Path:
    """The default model converted to GGUF at `precision` (a pdserve precision name: fp32, bf16, int8)."""
    if precision not in GGUF_TYPES:
        raise ValueError(f"no GGUF type for precision {precision!r}; known: {sorted(GGUF_TYPES)}")
    outtype = GGUF_TYPES[precision]
    root = home()
    out = root / "models" / f"{model_dir.name}-{outtype}.gguf"
    if out.is_file():
        return out
    with _Lock(root / "convert.lock"):
        if out.is_file():
            return out
        src = source_dir(root)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype]
        _run([*cmd, "--outfile", str(tmp)], root / "convert.log", env=converter_env(src, _converter_deps(root)))
        tmp.replace(out)
    return out


def server_version(binary: Path) -> str:
    """What `llama-server --version` prints (its build number and commit, `unknown` for a tree built outside git)."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return " ".join((done.stdout + done.stderr).split())[-200:]


def server_args(gguf: Path, port: int, threads: int, parallel: int, ctx_per_slot: int) -> list[str]:
    """llama-server's flags: `-c` is the total context that `--parallel` slots share, so it scales with them."""
    return [
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--parallel",
        str(parallel),
        "--cont-batching",
        "-c",
        str(ctx_per_slot * parallel),
        "--no-webui",
    ]


class LlamaServer:
    """A running llama-server on loopback; `close()` stops it."""

    def __init__(self, binary: Path, args: list[str], log: Path, start_timeout_s: float = 300.0) -> None:
        self.port = int(args[args.index("--port") + 1])
        self._log = log.open("w")
        self.proc = subprocess.Popen([str(binary), *args], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-8:]
                raise LlamaCppUnavailable(f"llama-server exited {self.proc.returncode}:\n  " + "\n  ".join(tail))
            if self._healthy():
                return
            time.sleep(0.5)
        self.close()
        raise LlamaCppUnavailable(f"llama-server not healthy after {start_timeout_s:.0f}s (log: {log})")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200 and json.loads(r.read() or b"{}").get("status", "ok") == "ok"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def sdist_sha256() -> str | None:
    """The sdist's digest: the build's identity where llama-server, built outside git, reports no commit."""
    tarballs = sorted((home() / "sdist").glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
    return hashlib.sha256(tarballs[0].read_bytes()).hexdigest() if tarballs else None


def source_commit() -> str | None:
    """llama.cpp's commit as the sdist's git metadata for its vendored tree records it, when it does."""
    src = home() / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    try:
        done = subprocess.run(["git", "-C", str(src), "log", "-1", "--format=%H %s"], capture_output=True, text=True)
    except OSError:
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def describe(binary: Path) -> dict[str, Any]:
    """What the JSON records about the llama.cpp side."""
    return {
        "source": f"llama-cpp-python=={LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp",
        "sdist_sha256": sdist_sha256(),
        "commit": source_commit(),
        "version": server_version(binary),
        "cmake_flags": list(CMAKE_FLAGS),
        "build_dir_key": home().name,
    }
