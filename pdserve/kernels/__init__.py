"""pdserve's C++ CPU kernels (csrc/): built once per machine with the system compiler against the installed torch,
cached under the pdserve cache, loaded as torch ops (``torch.ops.pdserve.*``): decode attention over the paged cache
(csrc/paged_decode.cpp), causal prefill attention (csrc/prefill_attention.cpp), a decoder layer's small ops fused
(csrc/fused.cpp), the local sums of the shared-memory collectives and the DCP merge (csrc/collectives.cpp), the
pinning of torch's OpenMP threads (csrc/threads.cpp), one row through a linear layer (csrc/gemv.cpp), W8A8 linear
layers on int8 weights (csrc/int8_gemm.cpp), and a tensor-parallel decode step's layers with their shared-memory
collectives in one call (csrc/decode_step.cpp).

Built with -march=native, so the cache key holds this CPU's flags as well as the source, torch's version and the
compiler flags. Where nothing can be built (no compiler, no headers), ``available()`` is False, the reason is logged
once, and callers keep their pure-torch path. PDSERVE_CPU_KERNELS=0 turns the kernels off."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import torch

from pdserve.default_model import cache_dir

log = logging.getLogger("pdserve.kernels")

_SOURCES = (
    "paged_decode.cpp",
    "prefill_attention.cpp",
    "fused.cpp",
    "collectives.cpp",
    "threads.cpp",
    "decode_step.cpp",
    "gemv.cpp",
    "int8_gemm.cpp",
)
_HEADERS = ("convert.h", "exp_nonpositive.h", "ops.h")
# Reassociation lets the compiler vectorise the float reductions. Not -ffast-math: linking a library with it pulls in
# crtfastmath, which turns on flush-to-zero for the whole process when the library loads (subnormals become 0).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-freciprocal-math",
    "-fopenmp",
    "-std=c++20",
    "-shared",
    "-fPIC",
]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(out: Path) -> None:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    lib = cpp_extension.library_paths()[0]
    compile_cmd = [cxx, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    compile_cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    objs = [out.with_name(f"{out.stem}.{Path(s).stem}.o") for s in _SOURCES]
    try:
        # one compiler per source at once: torch's headers make each a ~15 s compile
        procs = [
            subprocess.Popen(
                [*compile_cmd, "-c", str(Path(__file__).parent / "csrc" / s), "-o", str(o)],
                stderr=subprocess.PIPE,
                text=True,
            )
            for s, o in zip(_SOURCES, objs)
        ]
        errors = [p.communicate()[1] for p in procs]  # wait for every compiler before raising
        for p, err in zip(procs, errors):
            if p.returncode != 0:
                raise RuntimeError(f"{cxx} failed: {err.strip()[-2000:]}")
        # libgomp by soname: the process already holds torch's copy, so both share one OpenMP runtime
        link = [cxx, *_FLAGS, *map(str, objs), f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-o", str(out)]
        done = subprocess.run(link, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
    finally:
        for o in objs:
            o.unlink(missing_ok=True)


def library_path() -> Path:
    """Where this machine's build lives (built or not)."""
    h = hashlib.sha256()
    for s in (*_SOURCES, *_HEADERS):
        h.update((Path(__file__).parent / "csrc" / s).read_bytes())
    h.update(" ".join([torch.__version__, platform.python_version(), *_FLAGS, _cpu_flags()]).encode())
    return cache_dir() / "kernels" / f"pdserve_cpu_{h.hexdigest()[:16]}.so"


def _load() -> None:
    path = library_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build per machine; other processes wait and load it
            if not path.exists():
                log.info("building pdserve's CPU kernels (once per machine and torch version) into %s", path)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
                os.close(fd)
                try:
                    _build(Path(tmp))
                    os.replace(tmp, path)
                finally:
                    Path(tmp).unlink(missing_ok=True)
    torch.ops.load_library(str(path))


def available() -> bool:
    """Whether torch.ops.pdserve's CPU kernels are loaded (building them on first use)."""
    known = _state.get("ok")
    if known is not None:  # decided once per process; the model and the sampler ask every step
        return bool(known)
    with _lock:
        if "ok" not in _state:
            if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
                _state["ok"] = False
                log.info("pdserve's CPU kernels are off (PDSERVE_CPU_KERNELS=0)")
            else:
                try:
                    _load()
                    _state["ok"] = True
                except Exception as e:  # no compiler, no headers, a failed build: keep the torch path
                    _state["ok"] = False
                    log.warning("pdserve's CPU kernels are unavailable (%s); using torch's ops instead", e)
        return bool(_state["ok"])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sliding_window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row per sequence, q [B, Hq, D], over its first context_lens[b] cached keys (the last sliding_window
    of them when set) in k_cache / v_cache [num_blocks, block_size, Hkv, D] through block_tables [B, W]. Returns
    (out [B, Hq, D], lse [B, Hq] float32); a row with no keys gives 0 / -inf."""
    return torch.ops.pdserve.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, -1 if sliding_window is None else sliding_window, scale
    )


def paged_decode_attention_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sliding_window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_decode_attention over an fp8 cache (float8_e4m3fn or float8_e5m2 [num_blocks, block_size, Hkv, D]) with
    float32 scales [num_blocks, Hkv] per plane: each byte is dequantised in registers (csrc/paged_decode.cpp)."""
    bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}.get(k_cache.dtype)
    if bits is None or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"fp8 decode attention reads float8_e4m3fn / float8_e5m2 caches, got {k_cache.dtype}")
    window = -1 if sliding_window is None else sliding_window
    return torch.ops.pdserve.paged_decode_attention_fp8(
        q,
        k_cache.view(torch.uint8),
        v_cache.view(torch.uint8),
        k_scales,
        v_scales,
        block_tables,
        context_lens,
        window,
        scale,
        bits,
    )


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one sequence's n query rows q [n, Hq, D] over its ctx >= n keys k / v [ctx, Hkv, D] (any
    row stride, each row's heads contiguous; head size 64 or 128): query i, at position ctx - n + i, sees keys
    0..ctx - n + i. Returns (out [n, Hq, D], lse [n, Hq] float32)."""
    return torch.ops.pdserve.prefill_attention(q, k, v, scale)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x += delta (in place, when given), then (x, weight * RMSNorm(x)) for a contiguous [rows, hidden] x."""
    return torch.ops.pdserve.add_rms_norm(x, delta, weight, eps)


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotary embedding (HF's rotate_half) in place on the first ``heads`` heads of every row of qkv [rows, ...];
    cos / sin hold one [head_dim] row per qkv row."""
    torch.ops.pdserve.rope_(qkv, cos, sin, heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * inter] (gate first, as the fused gate/up projection lays it out)."""
    return torch.ops.pdserve.silu_mul(gate_up)


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [rows] int64, its log-probability [rows] float32) of float32 logits [rows, vocab]."""
    return torch.ops.pdserve.greedy_pick(logits)


def sum_in_order(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = rows[0] + rows[1] + ... left to right for rows [n, m] (each row contiguous), one rounding per addition
    as torch's add_: bit-identical to the loop of adds."""
    torch.ops.pdserve.sum_in_order(rows, out)
    return out


def pin_threads(cpus: Sequence[int], one_each: bool = True) -> int:
    """Pin the calling thread's OpenMP team (the threads torch's CPU ops run on): thread t to cpus[t % len(cpus)],
    or, with one_each=False, every thread to all of cpus. Returns the team's size."""
    return int(torch.ops.pdserve.pin_threads(list(cpus), one_each))


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_attn_states in one pass: float32 outs [N, T, H, D] and lses [N, T, H] (any strides, D contiguous) ->
    (out [T, H, D], lse [T, H])."""
    return torch.ops.pdserve.merge_partials(outs, lses)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for one row x [1, K] from weight [N, K] as stored, streaming the weight with
    prefetch (csrc/gemv.cpp): for a TP rank's shard several times faster than the packed oneDNN call."""
    return torch.ops.pdserve.gemv(x, weight, bias)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 rows of x [M, K] (any float dtype): (q [M, K] int8 in [-127, 127], scale [M] float32) with
    q = round(x * 127 / amax) and scale = amax / 127 per row (1 for an all-zero row)."""
    return torch.ops.pdserve.quantize_per_token(x)


def int8_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """The exact int32 sums xq [M, K] @ wq [N, K]^T of int8 operands (xq in [-127, 127]): int8_linear's
    accumulator, for checking it."""
    return torch.ops.pdserve.int8_matmul(xq, wq)


def int8_linear(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8 F.linear for x [M, K] (float32 / bfloat16 / float16) and int8 wq [N, K] with float32 w_scale [N]: x is
    quantised per row (quantize_per_token), summed in int32 and scaled back, acc * x_scale[m] * w_scale[n] + bias,
    in x's dtype (csrc/int8_gemm.cpp)."""
    return torch.ops.pdserve.int8_linear(x, wq, w_scale, bias)


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 blocks of `group` columns of x [M, K] (the last block may be shorter): (q [M, K] int8,
    scale [M, ceil(K / group)] float32), each block as quantize_per_token quantises a row."""
    return torch.ops.pdserve.quantize_per_group(x, group)


def int8_linear_grouped(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, group: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Group-wise W8A8 F.linear (llama.cpp's Q8_0): int8 wq [N, K] with float32 w_scale [N, ceil(K / group)], x
    [M, K] quantised per block of `group` columns (quantize_per_group); each block's int32 dot is exact and is
    summed in fp32 times x_scale[m, g] * w_scale[n, g], + bias, in x's dtype (csrc/int8_gemm.cpp)."""
    return torch.ops.pdserve.int8_linear_grouped(x, wq, w_scale, group, bias)


def decode_layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    dims: list[int],
    floats: list[float],
    tp_group: list[int],
    dcp_group: list[int],
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Every decoder layer of a decode step on this rank, as DecoderLayer.forward_fused computes them, with the TP
    all-reduces and the DCP merge through the shared-memory groups (ShmComm.native handles; both empty: a single
    rank, no collectives). weights: per layer (input norm, qkv, o, post-attention norm, gate_up, down), the linears
    packed in x's dtype (an int8 linear: its float32 scales, computed as int8_linear_grouped / int8_linear compute
    it), then (qkv, o, gate_up, down) as stored; biases: per layer (qkv, o, gate_up, down); dims: (layers,
    head_dim, q_size, kv_size, window or -1, dcp_size, int8 group); floats: (eps, scale). Returns (the residual
    stream, the last MLP output, each group's barrier count after the step). A broken group raises RuntimeError
    starting "RankFailure[rank]: " (ParallelState.native_failure)."""
    return torch.ops.pdserve.decode_layers(
        x,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        block_tables,
        context_lens,
        weights,
        biases,
        dims,
        floats,
        tp_group,
        dcp_group,
    )


def prefill_layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens: list[int],
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    dims: list[int],
    floats: list[float],
    rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer of a single rank's prefill of whole prompts (each sequence's keys are exactly its rows,
    cu_seqlens its row offsets), as DecoderLayer.forward_fused computes them; past the last layer's attention only
    ``rows`` go on (None: all). weights, biases, floats as decode_layers'; dims: (layers, head_dim, q_size,
    kv_size, int8 group). Returns (the residual stream, the last MLP output)."""
    return torch.ops.pdserve.prefill_layers(
        x, cos, sin, kv_cache, slot_mapping, cu_seqlens, weights, biases, dims, floats, rows
    )


def barrier_wait(group: list[int], what: str) -> int:
    """One wait of a shared-memory group's barrier as decode_layers waits (group: ShmComm.native or Barrier.native
    plus the members' TP ranks); returns the barrier count after it. A broken group raises RuntimeError starting
    "RankFailure[rank]: "."""
    return int(torch.ops.pdserve.barrier_wait(group, what))
