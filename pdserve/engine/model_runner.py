"""Turns a scheduled step into model inputs, runs the model on this rank's slice, returns logits.

StepInput is a plain picklable object: the driver builds it once for every DCP rank and broadcasts it, so every
rank of a pod runs the same step on its own share of the KV. Over shared memory it travels as one flat int64 array
(``encode`` / ``decode``), not as a pickled object graph."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import partial

import torch

from pdserve.attention import AttentionBackend, AttentionMetadata
from pdserve.engine import kv_quant
from pdserve.engine.block_manager import dcp_local_count, dcp_slot
from pdserve.engine.kv_cache import MLA, KVCacheLayout
from pdserve.engine.kv_connector import KVConnectorMetadata, KVConnectorSpec, KVConnectorWorker
from pdserve.engine.kv_quant import KVQuant
from pdserve.engine.scheduler import ScheduledStep
from pdserve.model import gguf_file, quant
from pdserve.model.config import ModelConfig
from pdserve.model.parallel_state import ParallelState
from pdserve.model.registry import build_model
from pdserve.model.weights import load_weights


@dataclass
class StepInput:
    is_prefill: bool
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    cu_seqlens_q: list[int]
    query_start_pos: list[int]
    logits_indices: torch.Tensor  # rows whose next token is sampled this step
    sample_rows: list[int]  # index into step.seqs for each logits row
    # Per DCP rank: where new tokens go and what each rank holds.
    slot_mappings: list[torch.Tensor]
    context_lens: list[torch.Tensor]
    block_tables: list[torch.Tensor]
    kv_meta: KVConnectorMetadata | None = None  # the KV connector's metadata for this step (kv_connector.py)
    # Driver only (never broadcast; only TP rank 0 computes logits): logits rows after the sampled ones, per
    # sequence asking for prompt logprobs: (index into step.seqs, first row, rows, first position).
    prompt_rows: list[tuple[int, int, int, int]] | None = None
    num_decodes: int = 0  # the leading sequences decode one token each (ScheduledStep.num_decodes)

    def encode(self) -> bytes:
        """[is_prefill, decodes, T, B, L, S, dcp, meta bytes, table widths...], every array, then the encoded kv_meta
        (L logits rows: S sampled, then any prompt-logprob rows)."""
        dcp = len(self.slot_mappings)
        extra = b"" if self.kv_meta is None else self.kv_meta.encode()
        t, b, n_logits = self.input_ids.numel(), len(self.query_start_pos), self.logits_indices.numel()
        head = [int(self.is_prefill), self.num_decodes, t, b, n_logits, len(self.sample_rows), dcp, len(extra)]
        head += [bt.shape[1] for bt in self.block_tables]
        parts = [
            torch.tensor(head + self.cu_seqlens_q + self.query_start_pos + self.sample_rows, dtype=torch.int64),
            self.input_ids,
            self.positions,
            self.logits_indices,
            *self.slot_mappings,
            *self.context_lens,
            *(bt.reshape(-1) for bt in self.block_tables),
        ]
        return torch.cat([p.to(torch.int64) for p in parts]).numpy().tobytes() + extra

    @staticmethod
    def decode(data: bytes) -> "StepInput":
        is_prefill, num_decodes, t, b, n_logits, n_samples, dcp, n_extra = struct.unpack_from("<8q", data)
        n_ints = (len(data) - n_extra) // 8
        a = torch.frombuffer(bytearray(data[: n_ints * 8]), dtype=torch.int64)
        widths = a[8 : 8 + dcp].tolist()
        at = 8 + dcp

        def take(n: int) -> torch.Tensor:
            nonlocal at
            at += n
            return a[at - n : at]

        lists = take(b + 1 + b + n_samples).tolist()
        ids, pos, logits = take(t), take(t), take(n_logits)
        slots = [take(t) for _ in range(dcp)]
        ctx = [take(b) for _ in range(dcp)]
        tables = [take(b * w).view(b, w) for w in widths]
        meta = KVConnectorMetadata.decode(data[n_ints * 8 :]) if n_extra else None
        return StepInput(
            bool(is_prefill),
            ids,
            pos,
            lists[: b + 1],
            lists[b + 1 : 2 * b + 1],
            logits,
            lists[2 * b + 1 :],
            slots,
            ctx,
            tables,
            meta,
            num_decodes=num_decodes,
        )


def build_step_input(step: ScheduledStep, block_size: int, dcp: int, interleave: int) -> StepInput:
    pos: list[int]
    ids, pos, cu, starts, logit_rows, sample_rows = [], [], [0], [], [], []
    slots: list[list[int]] = [[] for _ in range(dcp)]
    ctx: list[list[int]] = [[] for _ in range(dcp)]
    for i, (seq, n) in enumerate(zip(step.seqs, step.chunk_lens)):
        start = seq.num_computed
        all_ids = seq.all_ids
        ids.extend(all_ids[start : start + n])
        pos.extend(range(start, start + n))
        starts.append(start)
        cu.append(cu[-1] + n)
        for p in range(start, start + n):
            owner, li = dcp_slot(p, dcp, interleave)
            for r in range(dcp):
                slots[r].append(
                    seq.block_tables[r][li // block_size] * block_size + li % block_size if r == owner else -1
                )
        for r in range(dcp):
            ctx[r].append(dcp_local_count(start + n, dcp, interleave, r))
        if start + n == seq.num_tokens:  # this chunk reaches the end: its last row predicts the next token
            logit_rows.append(cu[-1] - 1)
            sample_rows.append(i)
    prompt_rows = []
    extra: list[int] = []
    for i, (seq, n) in enumerate(zip(step.seqs, step.chunk_lens)):
        if seq.prompt_logprobs is None:
            continue
        # Position p's logits score prompt token p + 1; positions already scored (before a preemption) are skipped.
        first = max(seq.num_computed, len(seq.prompt_lps))
        last = min(seq.num_computed + n, len(seq.prompt_ids) - 1)
        if first < last:
            row0 = cu[i] + first - seq.num_computed
            prompt_rows.append((i, len(logit_rows) + len(extra), last - first, first))
            extra.extend(range(row0, row0 + last - first))
    tables = []
    for r in range(dcp):
        width = max(len(s.block_tables[r]) for s in step.seqs)
        t = torch.zeros(len(step.seqs), max(width, 1), dtype=torch.int64)
        for i, s in enumerate(step.seqs):
            t[i, : len(s.block_tables[r])] = torch.tensor(s.block_tables[r], dtype=torch.int64)
        tables.append(t)
    return StepInput(
        is_prefill=step.is_prefill,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        cu_seqlens_q=cu,
        query_start_pos=starts,
        logits_indices=torch.tensor(logit_rows + extra, dtype=torch.int64),
        sample_rows=sample_rows,
        slot_mappings=[torch.tensor(s, dtype=torch.int64) for s in slots],
        context_lens=[torch.tensor(c, dtype=torch.int64) for c in ctx],
        block_tables=tables,
        prompt_rows=prompt_rows or None,
        num_decodes=step.num_decodes,
    )


class ModelRunner:
    """One rank's model weights and KV cache."""

    def __init__(
        self,
        model_path: str,
        cfg: ModelConfig,
        ps: ParallelState,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        exact_prefill: bool = False,
        kv_cache_dtype: str = "auto",
        quantization: str = "none",
    ) -> None:
        self.cfg, self.ps, self.block_size, self.device = cfg, ps, block_size, torch.device(device)
        with torch.device(self.device):
            self.model = build_model(cfg, ps, backend, max_positions=max_model_len).to(dtype)
        q8_0 = False
        gguf = gguf_file.is_gguf(model_path)
        if quant.checkpoint_int8(cfg):  # its scales are per channel, as the checkpoint holds them
            quant.make_int8(self.model, group=0)
        elif quantization == quant.INT8 or (gguf and gguf_file.holds_q8_0(model_path)):
            quant.make_int8(self.model)
            q8_0 = True
        load_weights(self.model, model_path)
        self.model.pack_weights()  # no-op off CPU
        if q8_0:  # llama.cpp's Q8_0 files hold the output matrix in Q8_0 too
            head = gguf_file.lm_head_q8_0(self.model, model_path) if gguf else None
            if head is not None:  # the file's own blocks
                self.model.lm_head_packed = head
            else:
                quant.quantize_lm_head(self.model)
        self.model.exact_prefill = exact_prefill
        # One contiguous region per rank (see docs/DESIGN.md), so a KV transport can register it once; on CPU on
        # transparent huge pages where the OS allows (NIXL's CMA reads pin source pages; docs/performance.md).
        self.kv_layout = KVCacheLayout.for_model(cfg, ps.tp_size, block_size)
        self.kv_cache = self.kv_layout.allocate(num_blocks, kv_quant.cache_dtype(kv_cache_dtype, dtype), self.device)
        # fp8: one float32 scale per (layer, plane, block, group) beside the cache (kv_quant.py); None otherwise
        self.kv_scales: torch.Tensor | None = None
        if kv_quant.is_fp8(self.kv_cache.dtype):
            self.kv_scales = torch.ones(self.kv_layout.scales_shape(num_blocks), device=self.device)
        # This rank's side of the pod's KV connector (LLMEngine.set_kv_connector); None costs nothing.
        self.kv_connector: KVConnectorWorker | None = None

    def start_kv_connector(self, spec: KVConnectorSpec) -> object:
        """Build this rank's connector worker (replacing and closing any earlier one); returns its info()."""
        self.close_kv_connector()
        self.kv_connector = spec.build(self)
        return self.kv_connector.info()

    def close_kv_connector(self) -> None:
        conn, self.kv_connector = self.kv_connector, None
        if conn is not None:
            conn.close()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer) from src to dst, for each (src, dst) of this rank."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        axis = 1 if self.kv_layout.kind == MLA else 2  # the block axis of the cache tensor (kv_cache.py)
        cache = self.kv_cache.view(torch.uint8) if self.kv_scales is not None else self.kv_cache  # no fp8 copy op
        cache.index_copy_(axis, dst, cache.index_select(axis, src))
        if self.kv_scales is not None:
            self.kv_scales.index_copy_(2, dst, self.kv_scales.index_select(2, src))

    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Logits of the rows to sample on TP rank 0; None on the other ranks."""
        r = self.ps.dcp_rank
        dev = self.device
        meta = AttentionMetadata(
            is_prefill=step.is_prefill,
            slot_mapping=step.slot_mappings[r].to(dev),
            cu_seqlens_q=step.cu_seqlens_q,
            query_start_pos=step.query_start_pos,
            context_lens=step.context_lens[r],
            block_tables=step.block_tables[r].to(dev),
            sliding_window=self.cfg.sliding_window,
            dcp_size=self.ps.dcp_size,
            dcp_rank=r,
            dcp_interleave=self.ps.dcp_interleave,
            num_decodes=step.num_decodes,
            exact=self.model.exact_prefill,
        )
        if self.kv_scales is not None:
            meta.kv_quant = KVQuant.for_step(
                self.kv_scales,
                self.kv_cache.dtype,
                self.block_size,
                meta.slot_mapping,
                step.cu_seqlens_q,
                meta.context_lens,
                step.block_tables[r],
            )
        conn, kv_meta = self.kv_connector, step.kv_meta
        hook = None
        if conn is not None and kv_meta is not None:
            conn.start_load_kv(kv_meta)
            hook = partial(_save_layer, conn, kv_meta)
        # every TP rank computes its shard of the LM head (ParallelState.vocab_parallel_logits); rank 0 gets logits
        logits_indices = step.logits_indices.to(dev)
        out = self.model(step.input_ids.to(dev), step.positions.to(dev), self.kv_cache, meta, logits_indices, hook)
        if hook is not None:
            assert conn is not None and kv_meta is not None
            conn.wait_for_save(kv_meta)
        return out


def _save_layer(conn: KVConnectorWorker, kv_meta: KVConnectorMetadata, layer: int) -> None:
    conn.save_kv_layer(layer, kv_meta)
