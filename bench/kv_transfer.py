"""KV transfer throughput: NIXL (UCX) and the TCP fallback next to a plain memcpy of the same bytes, same run.

Shape: SmolLM2-135M's KV (30 layers, 3 kv heads, head_dim 64, fp32, block 16), 2,048 and 8,192 tokens
(46,080 bytes per token: 94 MB and 377 MB). Prefill TP 1 runs in a spawned process holding a NIXL publisher
(which also serves the TCP path); decode pullers run here. Block tables are shuffled (a cache after some churn),
so every block is its own segment; the "(contiguous tables)" rows move the same bytes with consecutive block
tables on both sides (one segment per plane), which separates per-segment cost from the data path's bandwidth.
All layers are ready before the pull starts: this measures the data path, not the overlap with prefill compute
(the streaming rows below measure that).

Layouts: decode tp=1/dcp=1 (same layout, one 12 KB segment per block and plane), and tp=9/dcp=3 (each decode
rank takes one kv head of every third token: 256-byte segments, the worst case for a re-shard; the 9 ranks
pull concurrently from threads of this one process, so on a small CPU box they share its cores). There the nixl
rows are staged reads (whole source blocks, scattered locally: kv_transfer.staging), the nixl_direct rows one
NIXL descriptor per 256-byte segment.

KV regions on both sides are allocated as the engine allocates its KV cache (pdserve.engine.hugepages: on
transparent huge pages where THP allows; the result's "transparent_hugepages" says the mode), and the NIXL
puller runs with its defaults: on CPU a READ of 4 MiB or more is split in 2 parts posted from 2 threads. The
contiguous-table rows are the ones that approach memcpy (few large descriptors); shuffled 12 KB block
descriptors stay far below it (per-descriptor cost).

GB/s = bytes landed in decode regions / wall time of the pull (best of N). memcpy = torch ``copy_`` of one
contiguous buffer of the same size on ordinary 4 KB pages (best of N, each timed right after a pull): the
ceiling for moving those bytes on this machine. Between two huge-page buffers memcpy is faster (fewer TLB misses,
~1.6x here): the contiguous-table rows also report that ratio (ratios "*_vs_memcpy_hugepages_*", not in the table).

Streaming rows: a real SmolLM2 prefill (the engine with prefill_svc's publisher hook) of 2,048 and 8,191 tokens
(--quick: 1,024) in a spawned process, one decode puller here reading behind it. "on": published after layer 0,
each layer marked ready as its forward finishes (the service's behaviour); "off": published once the prefill step
returned. "end->landed" = last layer landed minus prefill step end (the time decode waits after prefill is done;
negative when the KV was complete before sampling finished); "share of prefill" = that (floored at 0) / prefill time.
ratios: end_to_decode_start_vs_prefill_streaming_{on,off}_N (target on <= 0.10) and transfer_vs_prefill_N (the
unhidden transfer, streaming off).

Checksum rows: the cost of the KV block checksums (pdserve/pod/kv_checksum.py, off by default, ``--kv-checksum`` on a
prefill pod): the prefill pod's sums over its region and the decode pod's over what its ranks read (decode TP/DCP as
above; ranks one after the other here, in parallel in a pod). ratios: checksum_vs_transfer_N = (prefill + decode
checksum seconds) / seconds of the TP 1 pull of the same request on the fastest path measured.

fp8 rows: the same SmolLM2 shape stored bf16 against fp8 (--kv-cache-dtype fp8: 8-bit bytes plus float32 scales per
layer, plane and KV head, which ride on the control channel), a 2,048-token prompt, prefill TP 1 to decode TP 1 and
TP 9 x DCP 3, publisher and pullers in this process, each path, best of N alternating. ratios:
kv_transfer_bytes_fp8_vs_bf16 (target <= 0.52) and kv_transfer_time_fp8_vs_bf16_{path}_tp{t}dcp{d} (<= 0.6).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from pdserve.engine.hugepages import empty_kv, thp_mode

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def _layout(tokens: int, tp: int = 1, dcp: int = 1):
    from kv_transfer.layout import KVLayout

    per_rank_tokens = -(-tokens // dcp)
    num_blocks = -(-per_rank_tokens // BLOCK) + 8
    return KVLayout(LAYERS, KV_HEADS, HEAD_DIM, "float32", BLOCK, tp_size=tp, dcp_size=dcp, num_blocks=num_blocks)


def _pattern_region(layout, rank: int) -> torch.Tensor:
    """int32 element i of the region holds i + rank * 2**28: any landed byte range is checkable anywhere."""
    n = int(np.prod(layout.region_shape()))
    t = empty_kv(n, dtype=torch.int32)  # on huge pages where THP allows, as the engine's KV cache
    torch.arange(n, dtype=torch.int32, out=t).add_(rank * (1 << 28))
    return t.view(torch.float32).view(layout.region_shape())


def _prefill_main(conn: Any, layout_dict: dict, backend: str, ucx_transports: str | None = None) -> None:
    from kv_transfer.factory import make_publisher
    from kv_transfer.layout import KVLayout

    layout = KVLayout.from_dict(layout_dict)
    pub = make_publisher(
        layout, {0: _pattern_region(layout, 0)}, backend=backend, lease_timeout_s=120, ucx_transports=ucx_transports
    )
    conn.send(pub.name)
    while True:
        cmd, arg = conn.recv()
        if cmd == "publish":
            table, tokens = arg
            lid = pub.publish("bench", {0: table}, tokens, layers_ready=LAYERS)
            conn.send(pub.handoff(lid).to_json())
        else:
            pub.close()
            conn.send(None)
            return


def _check_landed(plan, dst_rank: int, region: torch.Tensor, rng: np.random.Generator, samples: int = 64) -> None:
    """Sample segments of every layer: the bytes that landed are the source's pattern at the source offset."""
    dst_i32 = region.view(-1).view(torch.int32).numpy()
    for layer in (0, LAYERS // 2, LAYERS - 1):
        segs = plan.layer_segments(dst_rank, layer)
        for i in rng.choice(len(segs), size=min(samples, len(segs)), replace=False):
            r, so, do, n = int(segs.src_rank[i]), int(segs.src_offset[i]), int(segs.dst_offset[i]), int(segs.nbytes[i])
            want = np.arange(so // 4, (so + n) // 4, dtype=np.int64) + r * (1 << 28)
            if not np.array_equal(dst_i32[do // 4 : (do + n) // 4], want.astype(np.int32)):
                raise AssertionError(f"bench: wrong bytes landed (rank {dst_rank}, layer {layer}, segment {i})")


@functools.lru_cache(maxsize=2)
def _memcpy_bufs(nbytes: int, huge: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if huge:  # both on transparent huge pages, like the KV regions
        src, dst = empty_kv(nbytes, dtype=torch.uint8).fill_(7), empty_kv(nbytes, dtype=torch.uint8)
    else:
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)  # written: real pages, not the shared zero page
        dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    return src, dst


def _memcpy_gbps(nbytes: int, repeat: int, huge: bool = False) -> float:
    src, dst = _memcpy_bufs(nbytes, huge)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _stop_child(conn: Any, proc: Any, answer_s: float = 10) -> None:
    """Ask a bench child process (a prefill side) to exit, wait a bounded time for it, then kill what is left."""
    try:
        conn.send(("exit", None))
        conn.poll(answer_s)
    except (OSError, EOFError):
        pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()


def _ucx_tcp_main(conn: Any, token_counts: list[int], repeat: int) -> None:
    """NIXL with both sides' UCX held to TCP (as between nodes without RDMA), decode TP 1, in a process of its own:
    UCX takes its transports per process, so they must not reach the other rows' pullers."""
    from kv_transfer.factory import make_puller

    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only, here and in the prefill process spawned below
    src = dst = _layout(max(token_counts))
    ctx = mp.get_context("spawn")
    pconn, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_main, args=(child, src.to_dict(), "nixl", "tcp"), daemon=True)
    proc.start()
    out: dict[int, tuple[float, float, int, float]] = {}
    try:
        if not pconn.poll(120):
            raise RuntimeError("bench prefill process (UCX over TCP) did not start")
        pconn.recv()
        region = empty_kv(*dst.region_shape(), dtype=torch.float32)
        puller = make_puller(dst, 0, region, backend="nixl", io_timeout_s=60, min_segment_bytes=0, ucx_transports="tcp")
        try:
            rng = np.random.default_rng(1)
            for tokens in token_counts:
                out[tokens] = _pull_gbps(pconn, src, tokens, dst, [puller], [region], repeat, rng)
        finally:
            puller.close()
        conn.send(("ok", out))
    except BaseException as e:  # reported in the result
        conn.send(("err", f"{type(e).__name__}: {e}"))
    finally:
        _stop_child(pconn, proc)


def _ucx_tcp_rows(token_counts: list[int], repeat: int, raw: dict[str, Any]) -> tuple[list[dict], dict[str, float]]:
    """Rows and ratios of NIXL over UCX's TCP transport beside the default NIXL path (CMA here) and the TCP
    fallback of the same run."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_ucx_tcp_main, args=(child, token_counts, repeat))  # not daemonic: it has a child
    proc.start()
    try:
        status, value = conn.recv() if conn.poll(600) else ("err", "no answer within 600 s")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raw["nixl_ucx_tcp_error"] = value
        return [{"path": "nixl (UCX over TCP)", "decode tp/dcp": "1/1", "error": value}], {}
    rows, ratios = [], {}
    for tokens, (gbps, secs, nbytes, mem) in value.items():
        raw[f"nixl_ucx_tcp_tp1dcp1_{tokens}"] = {"GBps": gbps, "seconds": secs, "bytes": nbytes, "memcpy_GBps": mem}
        ratios[f"nixl_ucx_tcp_vs_memcpy_{tokens}"] = gbps / mem
        for other in ("nixl", "tcp"):
            o = raw.get(f"{other}_tp1dcp1_{tokens}")
            if o:
                ratios[f"nixl_ucx_tcp_vs_{other}_{tokens}"] = gbps / o["GBps"]
        rows.append(
            {
                "path": "nixl (UCX over TCP)",
                "decode tp/dcp": "1/1",
                "tokens": tokens,
                "MB": nbytes / 1e6,
                "seconds": secs,
                "GB/s": gbps,
                "memcpy GB/s": mem,
                "vs memcpy": gbps / mem,
            }
        )
    return rows, ratios


def _pull_gbps(
    conn, src_layout, tokens: int, dst_layout, pullers, regions, repeat: int, rng, contiguous: bool = False
) -> tuple[float, float, int, float]:
    """Best-of-``repeat`` GB/s of all decode ranks pulling one request concurrently; also seconds, bytes, and the
    best-of-``repeat`` memcpy GB/s of the same bytes, timed right after each pull (a busy box drifts: alternating
    the two keeps their ratio fair)."""
    from kv_transfer.plan import plan_reshard
    from kv_transfer.transport import KVHandoff

    def table(layout, r: int) -> list[int]:
        order = np.arange(layout.num_blocks) if contiguous else rng.permutation(layout.num_blocks)
        return order[: layout.blocks_needed(tokens, r)].tolist()

    src_table = table(src_layout, 0)
    dst_tables = [table(dst_layout, r) for r in range(dst_layout.tp_size)]
    best, nbytes, mem_best = float("inf"), 0, 0.0
    for it in range(repeat):
        conn.send(("publish", (src_table, tokens)))
        handoff = KVHandoff.from_json(conn.recv())
        results: list[Any] = [None] * len(pullers)

        def run(r: int, results: list[Any] = results, handoff: KVHandoff = handoff) -> None:
            try:
                results[r] = pullers[r].pull(handoff, dst_tables[r], timeout_s=120)
            except BaseException as e:  # re-raised below
                results[r] = e

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(pullers))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        for res in results:
            if isinstance(res, BaseException):
                raise res
        nbytes = sum(res.nbytes for res in results)
        best = min(best, dt)
        mem_best = max(mem_best, _memcpy_gbps(nbytes, 1))
        if it == 0:
            plan = plan_reshard(src_layout, [src_table], dst_layout, dst_tables, tokens)
            for r in range(len(pullers)):
                _check_landed(plan, r, regions[r], rng)
    return nbytes / best / 1e9, best, nbytes, mem_best


# ---- streaming: a real SmolLM2 prefill publishing layer by layer, a decode puller reading behind it ----------
def _stream_prefill_main(conn: Any, backend: str, max_tokens: int) -> None:
    """Prefill pod stand-in: the real engine and prefill_svc's per-rank publisher (prefill_svc.kv.KVHost), so
    streaming-on publishes after layer 0 and marks every later layer as its forward finishes, as the service does.
    Streaming off: the same publisher, the lease only published once the prefill step returned."""
    from kv_transfer.layout import KVLayout
    from kv_transfer.lease import new_lease_id
    from pdserve.engine.kv_connector import KVConnectorMetadata, KVConnectorScheduler
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams
    from prefill_svc.kv import KVHost, LeaseStart

    torch.manual_seed(0)
    blocks = -(-max_tokens // BLOCK) + 16
    eng = LLMEngine(
        EngineConfig(
            max_num_batched_tokens=max_tokens,
            prefill_chunk_size=max_tokens,
            max_num_seqs=1,
            num_kv_blocks=blocks,
            enable_prefix_caching=False,
            block_size=BLOCK,
        )
    )
    mc = eng.model_config
    dtype = str(eng.executor.kv_cache.dtype).replace("torch.", "")
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, BLOCK, tp_size=1, num_blocks=blocks)
    host = KVHost(eng, layout, backend, "127.0.0.1", 120.0, wake=lambda: None)
    publisher = host.rank0  # prefill_svc.kv.PrefillKVPublisher: its save_kv_layer publishes layer by layer
    publish_layer = publisher.save_kv_layer
    conn.send((layout.to_dict(), host.transport))
    rng = np.random.default_rng(1)
    while True:
        cmd, arg = conn.recv()
        if cmd != "prefill":
            host.close()
            eng.shutdown()
            conn.send(None)
            return
        tokens, streaming = arg
        lease: dict[str, Any] = {}

        class Leases(KVConnectorScheduler):
            def build_connector_meta(
                self, step: Any, streaming: bool = streaming, lease: dict[str, Any] = lease
            ) -> Any:
                seq = step.seqs[0]
                ls = LeaseStart(new_lease_id(), seq.request_id, tuple(seq.block_tables[0]), len(seq.prompt_ids))
                lease["start"] = ls
                return KVConnectorMetadata((ls,)) if streaming else None

        def save_layer(layer: int, meta: KVConnectorMetadata) -> None:
            publish_layer(layer, meta)
            if layer == 0 and meta.saves:  # the lease exists now: decode may start pulling
                conn.send(("handoff", host.handoff(meta.saves[0]).to_json()))

        eng.set_kv_connector(Leases())
        publisher.save_kv_layer = save_layer  # type: ignore[method-assign]  # the bench also hands off at layer 0
        ids = rng.integers(100, 10_000, size=tokens).tolist()
        eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0), request_id=f"bench-{tokens}-{streaming}")
        t0 = time.monotonic()
        while not any(o.finished for o in eng.step()):
            pass
        t1 = time.monotonic()
        ls = lease["start"]
        if not streaming:  # handed off only now, all layers ready
            host.rank0.publisher.publish(
                ls.request_id,
                {0: list(ls.block_ids)},
                ls.num_tokens,
                lease_id=ls.lease_id,
                layers_ready=layout.num_layers,
            )
            conn.send(("handoff", host.handoff(ls).to_json()))
        # Per-layer sums over the prompt's token slots (a last block's spare slots hold stale data on both sides).
        # The engine frees these blocks only when it schedules the next request.
        checksum = _kv_sums(eng.executor.kv_cache, list(ls.block_ids), tokens)
        conn.send(("prefilled", (t0, t1, checksum)))


def _kv_sums(kv: torch.Tensor, table: list[int], tokens: int) -> list[float]:
    per_layer = kv[:, :, table].flatten(2, 3)[:, :, :tokens]  # (layers, k/v, tokens, heads, dim)
    return per_layer.double().sum(dim=(1, 2, 3, 4)).tolist()


def _streaming(
    quick: bool, backend: str, token_counts: list[int] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, float]]:
    from kv_transfer.factory import make_puller
    from kv_transfer.layout import KVLayout
    from kv_transfer.transport import KVHandoff

    # 8,191: SmolLM2's 8,192 positions hold the prompt + 1 token. --quick: one short prompt (a CPU prefill of
    # 2,048 tokens alone can take half a minute on a busy 2-core box).
    token_counts = token_counts or ([1024] if quick else [2048, 8191])
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_stream_prefill_main, args=(child, backend, max(token_counts)), daemon=True)
    proc.start()
    rows, raw, ratios = [], {}, {}
    puller = None
    try:
        if not conn.poll(300):
            raise RuntimeError("bench prefill engine did not start")
        layout_d, transport = conn.recv()
        layout = KVLayout.from_dict(layout_d)
        region = empty_kv(*layout.region_shape(), dtype=torch.float32)
        puller = make_puller(layout, 0, region, backend=backend, io_timeout_s=60)
        rng = np.random.default_rng(2)

        def one(tokens: int, streaming: bool) -> dict[str, Any]:
            conn.send(("prefill", (tokens, streaming)))
            kind, hj = conn.recv()
            assert kind == "handoff", kind
            handoff = KVHandoff.from_json(hj)
            table = rng.permutation(layout.num_blocks)[: layout.blocks_needed(tokens, 0)].tolist()
            t_pull = time.monotonic()
            res = puller.pull(handoff, table, timeout_s=600)
            kind, (t0, t1, checksum) = conn.recv()
            got = _kv_sums(region, table, tokens)
            bad = [i for i, (a, b) in enumerate(zip(got, checksum)) if not np.isclose(a, b, rtol=1e-9, atol=1e-6)]
            if bad:
                raise AssertionError(f"bench: landed KV of layers {bad} differs from prefill's ({tokens} tokens)")
            last = res.layer_landed_at[-1]
            return {
                "prefill_s": t1 - t0,
                "pull_s": last - t_pull,
                "end_to_landed_s": last - t1,
                "first_layer_after_start_s": res.layer_landed_at[0] - t0,
                "bytes": res.nbytes,
                "transport": res.transport,
            }

        one(256, True)  # warm-up: engine, handshake, NIXL connection (a running pod has them)
        for tokens in token_counts:
            for streaming in (True, False):
                m = one(tokens, streaming)
                mode = "on" if streaming else "off"
                raw[f"stream_{mode}_{tokens}"] = m
                share = max(m["end_to_landed_s"], 0.0) / m["prefill_s"]
                ratios[f"end_to_decode_start_vs_prefill_streaming_{mode}_{tokens}"] = share
                rows.append(
                    {
                        "path": m["transport"],
                        "streaming": mode,
                        "tokens": tokens,
                        "MB": m["bytes"] / 1e6,
                        "prefill s": m["prefill_s"],
                        "pull s": m["pull_s"],
                        "end->landed s": m["end_to_landed_s"],
                        "share of prefill": share,
                    }
                )
            ratios[f"transfer_vs_prefill_{tokens}"] = (
                raw[f"stream_off_{tokens}"]["end_to_landed_s"] / raw[f"stream_off_{tokens}"]["prefill_s"]
            )
    finally:
        if puller is not None:
            puller.close()
        _stop_child(conn, proc, answer_s=30)
    return rows, raw, ratios


def _checksum_cost(
    token_counts: list[int], raw: dict[str, Any], repeat: int
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, float]]:
    """Seconds (best of ``repeat``) of the prefill side's and the decode side's block checksums of one request."""
    from pdserve.pod.kv_checksum import partial_checksums

    rows, out, ratios = [], {}, {}
    rng = np.random.default_rng(1)
    for tokens in token_counts:
        src = _layout(tokens)
        src_region = empty_kv(*src.region_shape(), dtype=torch.float32).normal_()
        src_table = rng.permutation(src.num_blocks)[: src.blocks_needed(tokens, 0)].tolist()
        nbytes = tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            partial_checksums(src, 0, src_region, src_table, tokens, BLOCK)
            best = min(best, time.perf_counter() - t0)
        times = {"prefill": best}
        for tp, dcp in ((1, 1), (9, 3)):
            dst = _layout(tokens, tp, dcp)
            regions = [empty_kv(*dst.region_shape(), dtype=torch.float32).normal_() for _ in range(tp)]
            tables = [rng.permutation(dst.num_blocks)[: dst.blocks_needed(tokens, r)].tolist() for r in range(tp)]
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                for r in range(tp):
                    partial_checksums(dst, r, regions[r], tables[r], tokens, BLOCK)
                best = min(best, time.perf_counter() - t0)
            times[f"decode tp{tp}dcp{dcp}"] = best
        del src_region
        for side, secs in times.items():
            rows.append(
                {
                    "path": f"checksum ({side})",
                    "decode tp/dcp": side.removeprefix("decode tp").replace("dcp", "/") if side != "prefill" else "-",
                    "tokens": tokens,
                    "MB": nbytes / 1e6,
                    "seconds": secs,
                    "GB/s": nbytes / secs / 1e9,
                }
            )
        out[f"checksum_{tokens}"] = times
        pulls = [v["seconds"] for k, v in raw.items() if k.endswith(f"_tp1dcp1_{tokens}") and "seconds" in v]
        if pulls:
            ratios[f"checksum_vs_transfer_{tokens}"] = (times["prefill"] + times["decode tp1dcp1"]) / min(pulls)
    return rows, out, ratios


def _fp8_rows(quick: bool, backends: list[str]) -> tuple[list[dict], dict[str, Any], dict[str, float]]:
    from kv_transfer.factory import make_publisher, make_puller
    from kv_transfer.layout import KVLayout

    tokens, repeat = 2048, 3 if quick else 6
    rows: list[dict] = []
    raw: dict[str, Any] = {}
    ratios: dict[str, float] = {}

    def layout(dtype: str, tp: int = 1, dcp: int = 1) -> KVLayout:
        blocks = -(-tokens // dcp // BLOCK) + 8
        return KVLayout(LAYERS, KV_HEADS, HEAD_DIM, dtype, BLOCK, tp_size=tp, dcp_size=dcp, num_blocks=blocks)

    def region(lay: KVLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
        r = empty_kv(*lay.region_shape(), dtype=getattr(torch, lay.dtype))
        r.view(torch.uint8).view(-1).random_(0, 120)  # finite values in both dtypes
        return r, (torch.rand(lay.scales_shape()) + 0.1 if lay.has_scales else None)

    for backend in backends:
        for tp, dcp in ((1, 1), (9, 3)):
            sides = {}
            for name, dtype in (("bf16", "bfloat16"), ("fp8", "float8_e4m3fn")):
                src, dst = layout(dtype), layout(dtype, tp, dcp)
                reg, sc = region(src)
                pub = make_publisher(
                    src, {0: reg}, backend=backend, lease_timeout_s=60, scales=None if sc is None else {0: sc}
                )
                dregs = [region(dst) for _ in range(tp)]
                pullers = [make_puller(dst, r, dregs[r][0], backend=backend, scales=dregs[r][1]) for r in range(tp)]
                sides[name] = (src, dst, pub, pullers)
            try:
                best: dict[str, float] = {}
                # the first round opens the sessions (handshakes, NIXL metadata): not timed
                for it in range(repeat + 1):
                    for name, (src, dst, pub, pullers) in sides.items():
                        table = list(range(src.blocks_needed(tokens, 0)))
                        handoff = pub.handoff(pub.publish("b", {0: table}, tokens, layers_ready=LAYERS))
                        res: list[Any] = [None] * tp

                        def pull(r: int, pullers=pullers, handoff=handoff, res=res, dst=dst) -> None:
                            res[r] = pullers[r].pull(handoff, list(range(dst.blocks_needed(tokens, r))), timeout_s=120)

                        threads = [threading.Thread(target=pull, args=(r,)) for r in range(tp)]
                        t0 = time.perf_counter()
                        for t in threads:
                            t.start()
                        for t in threads:
                            t.join()
                        dt = time.perf_counter() - t0
                        if any(x is None for x in res):
                            raise RuntimeError(f"fp8 bench pull failed ({backend}, tp {tp} dcp {dcp})")
                        if it == 0:
                            continue
                        # the scales cross as float32 values: one per (layer, plane, head) and prefill rank
                        scale_bytes = src.num_layers * 2 * KV_HEADS * 4 if src.has_scales else 0
                        nbytes = sum(x.nbytes for x in res) + scale_bytes * tp
                        best[name] = min(best.get(name, float("inf")), dt)
                        raw[f"fp8_{backend}_tp{tp}dcp{dcp}_{name}"] = {"bytes": nbytes, "seconds": best[name]}
            finally:
                for _, _, pub, pullers in sides.values():
                    for p in pullers:
                        p.close()
                    pub.close()
            b, f = raw[f"fp8_{backend}_tp{tp}dcp{dcp}_bf16"], raw[f"fp8_{backend}_tp{tp}dcp{dcp}_fp8"]
            ratios["kv_transfer_bytes_fp8_vs_bf16"] = f["bytes"] / b["bytes"]
            ratios[f"kv_transfer_time_fp8_vs_bf16_{backend}_tp{tp}dcp{dcp}"] = f["seconds"] / b["seconds"]
            for name, r in (("bf16", b), ("fp8", f)):
                rows.append(
                    {
                        "path": f"{backend} {name} KV",
                        "decode tp/dcp": f"{tp}/{dcp}",
                        "tokens": tokens,
                        "MB": r["bytes"] / 1e6,
                        "seconds": r["seconds"],
                        "GB/s": r["bytes"] / r["seconds"] / 1e9,
                    }
                )
    return rows, raw, ratios


def run(quick: bool = False) -> dict[str, Any]:
    from kv_transfer.factory import make_puller, nixl_available
    from kv_transfer.plan import plan_reshard

    token_counts = [2048, 8192]
    repeat = 2 if quick else 4
    nixl_ok, nixl_why = nixl_available()
    backends = ["nixl", "tcp"] if nixl_ok else ["tcp"]
    src = _layout(max(token_counts))
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_main, args=(child, src.to_dict(), "nixl" if nixl_ok else "tcp"), daemon=True)
    proc.start()
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    try:
        if not conn.poll(120):
            raise RuntimeError("bench prefill process did not start")
        publisher_kind = conn.recv()
        dst_cases = [(1, 1), (9, 3)]
        for tp, dcp in dst_cases:
            dst = _layout(max(token_counts), tp, dcp)
            regions = [empty_kv(*dst.region_shape(), dtype=torch.float32) for _ in range(tp)]
            # nixl rows never fall back to TCP (min_segment_bytes=0): they measure the NIXL path as the puller
            # runs it (staged for head-sliced plans); "nixl_direct" turns staging off (one descriptor per segment).
            variants = [(b, b, {"min_segment_bytes": 0} if b == "nixl" else {}) for b in backends]
            if tp > 1 and "nixl" in backends:
                variants.append(("nixl_direct", "nixl", {"min_segment_bytes": 0, "stage_bytes": 0}))
            for backend, kind, extra in variants:
                pullers = [make_puller(dst, r, regions[r], backend=kind, io_timeout_s=60, **extra) for r in range(tp)]
                try:
                    for tokens in token_counts:
                        if quick and tp > 1 and tokens > 2048:
                            continue  # the 256-byte-segment case at 8k takes a while on a small box
                        gbps, secs, nbytes, mem = _pull_gbps(conn, src, tokens, dst, pullers, regions, repeat, rng)
                        t_plan = time.perf_counter()
                        plan = plan_reshard(
                            src,
                            [list(range(src.blocks_needed(tokens, 0)))],
                            dst,
                            [list(range(dst.blocks_needed(tokens, r))) for r in range(tp)],
                            tokens,
                        )
                        t_plan = time.perf_counter() - t_plan
                        segs = sum(len(plan.layer_segments(r, 0)) for r in range(tp)) * LAYERS
                        key = f"{backend}_tp{tp}dcp{dcp}_{tokens}"
                        raw[key] = {
                            "GBps": gbps,
                            "seconds": secs,
                            "bytes": nbytes,
                            "memcpy_GBps": mem,
                            "plan_ms": t_plan * 1e3,
                            "segments_contiguous_tables": segs,
                        }
                        suffix = f"_{tokens}" if (tp, dcp) == (1, 1) else f"_tp{tp}dcp{dcp}_{tokens}"
                        ratios[f"{backend}_vs_memcpy{suffix}"] = gbps / mem
                        rows.append(
                            {
                                "path": backend,
                                "decode tp/dcp": f"{tp}/{dcp}",
                                "tokens": tokens,
                                "MB": nbytes / 1e6,
                                "seconds": secs,
                                "GB/s": gbps,
                                "memcpy GB/s": mem,
                                "vs memcpy": gbps / mem,
                            }
                        )
                        if tp == 1:
                            # Same bytes, block tables consecutive on both sides: one descriptor per plane instead
                            # of one per block and plane. Shows what the data path does without fragmentation.
                            gbps_c, secs_c, _, mem_c = _pull_gbps(
                                conn, src, tokens, dst, pullers, regions, repeat, rng, contiguous=True
                            )
                            # memcpy between two huge-page buffers is faster still (TLB): that ratio too, raw only
                            mem_h = _memcpy_gbps(nbytes, repeat, huge=True)
                            raw[f"{key}_contiguous"] = {
                                "GBps": gbps_c,
                                "seconds": secs_c,
                                "memcpy_GBps": mem_c,
                                "memcpy_hugepages_GBps": mem_h,
                            }
                            ratios[f"{backend}_vs_memcpy_contiguous_tables_{tokens}"] = gbps_c / mem_c
                            ratios[f"{backend}_vs_memcpy_hugepages_contiguous_tables_{tokens}"] = gbps_c / mem_h
                            rows.append(
                                {
                                    "path": f"{backend} (contiguous tables)",
                                    "decode tp/dcp": "1/1",
                                    "tokens": tokens,
                                    "MB": nbytes / 1e6,
                                    "seconds": secs_c,
                                    "GB/s": gbps_c,
                                    "memcpy GB/s": mem_c,
                                    "vs memcpy": gbps_c / mem_c,
                                }
                            )
                finally:
                    for p in pullers:
                        p.close()
        for tokens in token_counts:  # the two paths against each other, same run
            a, b = raw.get(f"nixl_tp1dcp1_{tokens}"), raw.get(f"tcp_tp1dcp1_{tokens}")
            if a and b:
                ratios[f"nixl_vs_tcp_{tokens}"] = a["GBps"] / b["GBps"]
    finally:
        _stop_child(conn, proc)
    if nixl_ok:  # NIXL between nodes without RDMA: UCX held to TCP, beside CMA and the TCP fallback above
        u_rows, u_ratios = _ucx_tcp_rows(token_counts if not quick else token_counts[:1], repeat, raw)
        rows += u_rows
        ratios.update(u_ratios)
    c_rows, c_raw, c_ratios = _checksum_cost(token_counts if not quick else token_counts[:1], raw, repeat)
    rows += c_rows
    raw.update(c_raw)
    ratios.update(c_ratios)
    f_rows, f_raw, f_ratios = _fp8_rows(quick, backends)
    rows += f_rows
    raw.update(f_raw)
    ratios.update(f_ratios)
    s_rows, s_raw, s_ratios = _streaming(quick, "nixl" if nixl_ok else "tcp")
    rows += s_rows
    raw.update(s_raw)
    ratios.update(s_ratios)
    return {
        "table": rows,
        "ratios": ratios,
        "raw": raw,
        "nixl": {"available": nixl_ok, "why": nixl_why, "publisher": publisher_kind},
        "shape": {
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "float32",
            "block_size": BLOCK,
            "bytes_per_token": LAYERS * 2 * KV_HEADS * HEAD_DIM * 4,
        },
        "streaming": {
            "what": "real SmolLM2 prefill (engine + prefill_svc.kv publisher) with a decode puller "
            "reading behind it; share = (last layer landed - prefill step returned) / prefill step time",
            **{k: v for k, v in s_raw.items()},
        },
        "transparent_hugepages": thp_mode() or "unavailable",  # KV regions advised onto them unless "never"
        "cpu_count": os.cpu_count(),
        "quick": quick,
    }
