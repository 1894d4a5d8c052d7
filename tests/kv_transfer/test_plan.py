"""plan_reshard: byte-exact against a per-token reference, over many layout pairs."""

from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest
import torch
from kv_reference import as_bytes, empty_region, full_kv, random_tables, write_rank

from kv_transfer.layout import KVLayout
from kv_transfer.plan import apply_segments, plan_reshard
from kv_transfer.region import RegionBytes
from pdserve import parallel_config as pc


def _layout(kvh, tp, dcp=1, inter=1, bs=16, nb=24, layers=3, dim=4, dtype="float32"):
    return KVLayout(
        num_layers=layers,
        num_kv_heads=kvh,
        head_dim=dim,
        dtype=dtype,
        block_size=bs,
        tp_size=tp,
        dcp_size=dcp,
        interleave=inter,
        num_blocks=nb,
    )


def _valid_cases():
    cases = []
    for kvh, src_tp, dst_tp, dcp, inter, (sbs, dbs) in itertools.product(
        (1, 2, 4), (1, 2, 4), (1, 2, 4, 8), (1, 2, 3, 4), (1, 4), ((16, 16), (32, 16), (16, 32))
    ):
        try:
            src = _layout(kvh, src_tp, bs=sbs)
            dst = _layout(kvh, dst_tp, dcp, inter, bs=dbs)
        except ValueError:
            continue
        cases.append((src, dst))
    # DCP 3 needs 3 | tp // kv heads: SmolLM2-like 3 kv heads at TP 9, and MQA at TP 3 / 6
    for kvh, src_tp, dst_tp, inter in ((3, 1, 9, 1), (3, 3, 9, 4), (1, 1, 3, 4), (1, 2, 6, 1)):
        cases.append((_layout(kvh, src_tp), _layout(kvh, dst_tp, 3, inter)))
    return cases


CASES = _valid_cases()


def _check_case(src: KVLayout, dst: KVLayout, num_tokens: int, seed: int, layers=None) -> None:
    rng = random.Random(seed)
    full = full_kv(src, num_tokens, seed)
    src_tables = random_tables(src, num_tokens, rng)
    dst_tables = random_tables(dst, num_tokens, rng)
    src_regions = []
    for r in range(src.tp_size):
        reg = empty_region(src, 1000 + r)
        write_rank(src, r, full, src_tables[r], reg)
        src_regions.append(reg)
    plan = plan_reshard(src, src_tables, dst, dst_tables, num_tokens, layers=layers)
    src_bytes = {r: as_bytes(t) for r, t in enumerate(src_regions)}
    for d in range(dst.tp_size):
        got = empty_region(dst, 2000 + d)
        want = got.clone()
        if layers is None:
            write_rank(dst, d, full, dst_tables[d], want)
        else:  # only the planned layers land
            tmp = want.clone()
            write_rank(dst, d, full, dst_tables[d], tmp)
            want[layers.start : layers.stop] = tmp[layers.start : layers.stop]
        apply_segments(src_bytes, as_bytes(got), plan.segments(d))
        assert torch.equal(got, want), f"decode rank {d}: {src} -> {dst}"


def test_enough_cases_and_kinds():
    # prefill TP != decode TP, prefill TP > kv heads, DCP 1..4, interleave 1 and 4, mixed block sizes
    assert len(CASES) > 60
    assert any(s.tp_size > s.num_kv_heads for s, _ in CASES)
    assert {d.dcp_size for _, d in CASES} == {1, 2, 3, 4}
    assert {d.interleave for _, d in CASES} == {1, 4}


@pytest.mark.parametrize(
    "src,dst",
    CASES,
    ids=lambda lay: f"kvh{lay.num_kv_heads}tp{lay.tp_size}dcp{lay.dcp_size}i{lay.interleave}bs{lay.block_size}",
)
def test_plan_matches_reference(src, dst):
    num_tokens = 1 + (hash((src, dst)) % 90)
    _check_case(src, dst, num_tokens, seed=num_tokens)


@pytest.mark.parametrize("num_tokens", [0, 1, 15, 16, 17, 64])
def test_edge_token_counts(num_tokens):
    _check_case(_layout(2, 2), _layout(2, 4, 2, 4), num_tokens, seed=7)


def test_layer_subset_and_bf16():
    src, dst = _layout(2, 1, layers=5, dtype="bfloat16"), _layout(2, 4, 2, 1, layers=5, dtype="bfloat16")
    _check_case(src, dst, 40, seed=3, layers=range(1, 4))
    plan = plan_reshard(src, [list(range(3))], dst, [list(range(2))] * 4, 40, layers=range(2, 3))
    segs = plan.layer_segments(0, 2)
    assert segs.total_nbytes == plan.ranks[0].nbytes_per_layer == 2 * 20 * 4 * 2


def test_coalescing_contiguous_tables():
    """Same TP both sides, consecutive block tables: one segment per (layer, k/v) plane."""
    src = _layout(4, 2, nb=64, layers=2)
    dst = _layout(4, 2, nb=64, layers=2)
    plan = plan_reshard(src, [list(range(10, 14))] * 2, dst, [list(range(30, 34))] * 2, 64)
    for d in range(2):
        assert len(plan.ranks[d].base) == 1
        assert len(plan.layer_segments(d, 1)) == 2
    # prefill TP2 -> decode TP1: each slot has 2 heads from rank 0 then 2 from rank 1: per-slot segments
    dst1 = _layout(4, 1, nb=64, layers=2)
    plan = plan_reshard(src, [list(range(4))] * 2, dst1, [list(range(4))], 64)
    assert len(plan.ranks[0].base) == 2 * 64 and set(plan.ranks[0].src_ranks()) == {0, 1}


def test_replicas_are_spread():
    """Prefill TP4 over 2 kv heads (each head twice): decode TP4 ranks read from 4 different ranks."""
    src = _layout(2, 4)
    dst = _layout(2, 4)
    tables = [[0, 1]] * 4
    plan = plan_reshard(src, tables, dst, tables, 20)
    assert [plan.ranks[d].src_ranks() for d in range(4)] == [[0], [1], [2], [3]]


def test_rejects_bad_inputs():
    src, dst = _layout(2, 1), _layout(2, 2)
    with pytest.raises(ValueError):
        plan_reshard(src, [[0]], dst, [[0], [0]], 40)  # table too short
    with pytest.raises(ValueError):
        plan_reshard(src, [[0, 1, 99]], dst, [[0, 1, 2], [3, 4, 5]], 40)  # block id out of range
    with pytest.raises(ValueError):
        plan_reshard(src, [[0, 1, 2]], _layout(4, 2), [[0, 1, 2], [3, 4, 5]], 40)  # other model
    with pytest.raises(ValueError):
        _layout(2, 2, dcp=2)  # a DCP group would mix kv heads


def test_layout_agrees_with_parallel_config():
    for kvh, tp, dcp, inter in itertools.product((1, 2, 3), (1, 2, 3, 6, 9), (1, 3), (1, 4)):
        try:
            lay = _layout(kvh, tp, dcp, inter)
        except ValueError:
            continue
        toks = np.arange(200)
        assert lay.token_dcp_rank(toks).tolist() == [pc.dcp_owner(int(t), dcp, inter) for t in toks]
        assert lay.token_local_index(toks).tolist() == [pc.dcp_local_index(int(t), dcp, inter) for t in toks]
        for r in range(tp):
            assert list(lay.kv_heads_of_rank(r)) == pc.kv_heads_for_tp_rank(kvh, tp, r)
            assert lay.blocks_needed(77, r) == pc.dcp_local_num_blocks(77, dcp, inter, r % dcp, 16)
    lay = _layout(3, 1, bs=16, nb=10, layers=2, dim=64)
    region = torch.arange(int(np.prod(lay.region_shape())), dtype=torch.float32).view(lay.region_shape())
    for idx in [(0, 0, 0, 0, 0), (1, 1, 9, 15, 2), (1, 0, 3, 7, 1)]:
        assert lay.byte_offset(*idx) == int(region[idx][0].item()) * 4
    assert lay.region_nbytes() == region.numel() * 4


def test_gather_scatter_roundtrip():
    src, dst = _layout(2, 2), _layout(2, 1)
    rng = random.Random(0)
    full = full_kv(src, 50, 1)
    st, dt = random_tables(src, 50, rng), random_tables(dst, 50, rng)
    regs = [empty_region(src, r) for r in range(2)]
    for r in range(2):
        write_rank(src, r, full, st[r], regs[r])
    plan = plan_reshard(src, st, dst, dt, 50)
    got, want = empty_region(dst, 5), empty_region(dst, 5)
    write_rank(dst, 0, full, dt[0], want)
    for r in (0, 1):
        segs = plan.segments(0).from_src_rank(r)
        packed = np.empty(segs.total_nbytes, np.uint8)
        RegionBytes(regs[r]).gather(segs.src_offset, segs.nbytes, packed)
        RegionBytes(got).scatter(packed, segs.dst_offset, segs.nbytes)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dst_tp,dst_dcp", [(1, 1), (9, 3)])
def test_plan_speed_8k_tokens_30_layers(dst_tp, dst_dcp):
    """SmolLM2-135M KV shape; random (fragmented) block tables; all layers materialised."""
    src = KVLayout(30, 3, 64, "float32", 16, tp_size=1, num_blocks=1024)
    dst = KVLayout(30, 3, 64, "float32", 16, tp_size=dst_tp, dcp_size=dst_dcp, num_blocks=1024)
    rng = np.random.default_rng(0)
    st = [rng.permutation(1024)[:512].tolist()]
    dt = [rng.permutation(1024)[: dst.blocks_needed(8192, r)].tolist() for r in range(dst_tp)]
    t0 = time.perf_counter()
    plan = plan_reshard(src, st, dst, dt, 8192)
    n = sum(len(plan.layer_segments(d, layer)) for d in range(dst_tp) for layer in plan.layers)
    dt_s = time.perf_counter() - t0
    assert plan.total_nbytes == 30 * 2 * 8192 * 3 * 64 * 4  # each head once per DCP group; one group here
    assert n > 0
    assert dt_s < 0.5, f"plan took {dt_s * 1e3:.1f} ms"  # ~10-30 ms here; loose bound for a shared box


# ---- MLA latent caches --------------------------------------------------------------------------
def _mla(tp, dcp=1, inter=1, bs=16, nb=24, layers=3, dim=12, dtype="float32"):
    return KVLayout.mla(layers, dim, dtype, bs, tp_size=tp, dcp_size=dcp, interleave=inter, num_blocks=nb)


MLA_DECODE = [(1, 1), (2, 2), (4, 2), (4, 4), (8, 8), (2, 1), (8, 4)]
MLA_CASES = [
    (_mla(src_tp, bs=sbs), _mla(tp, dcp, inter, bs=dbs))
    for src_tp in (1, 2, 4)
    for tp, dcp in MLA_DECODE
    for inter in (1, 4)
    for sbs, dbs in ((16, 16), (32, 16), (16, 32))
]


def test_mla_layout_shape_and_bytes():
    lay = _mla(8, 8, 4, bs=16, nb=10, layers=2, dim=12)
    assert lay.kv_planes == 1 and lay.kv_heads_per_rank == 1
    assert lay.region_shape() == (2, 10, 16, 12)
    region = torch.arange(int(np.prod(lay.region_shape())), dtype=torch.float32).view(lay.region_shape())
    for layer, block, slot in [(0, 0, 0), (1, 9, 15), (1, 3, 7)]:
        assert lay.byte_offset(layer, 0, block, slot) == int(region[layer, block, slot, 0].item()) * 4
    assert lay.region_nbytes() == region.numel() * 4
    assert KVLayout.from_dict(lay.to_dict()) == lay
    # every rank keeps the whole latent: DCP only splits tokens, so dcp == tp is valid
    assert all(lay.kv_heads_of_rank(r) == range(0, 1) for r in range(8))
    with pytest.raises(ValueError, match="one latent kv head"):
        KVLayout(2, 2, 12, "float32", 16, use_mla=True)
    with pytest.raises(ValueError, match="must divide"):
        _mla(4, 3)
    assert not _mla(1).same_model(_layout(1, 1, dim=12))  # a GQA cache of the same width is another tensor


@pytest.mark.parametrize(
    "src,dst", MLA_CASES, ids=lambda lay: f"tp{lay.tp_size}dcp{lay.dcp_size}i{lay.interleave}bs{lay.block_size}"
)
def test_mla_plan_matches_reference(src, dst):
    num_tokens = 1 + (hash((src, dst)) % 90)
    _check_case(src, dst, num_tokens, seed=num_tokens)


def test_mla_each_rank_gets_exactly_its_dcp_shard():
    """Decode TP 8 x DCP 4 from prefill TP 2: a rank receives only its shard's tokens (one latent row each), and
    ranks of different DCP groups with the same dcp_rank receive the same bytes."""
    src, dst = _mla(2, nb=64), _mla(8, 4, 4, nb=64)
    n = 101
    rng = random.Random(5)
    st, dt = random_tables(src, n, rng), random_tables(dst, n, rng)
    dt[4:] = dt[:4]  # same tables in both DCP groups: the bytes written must then be the same too
    plan = plan_reshard(src, st, dst, dt, n)
    full = full_kv(src, n, 9)
    regs = {}
    for r in range(2):
        regs[r] = empty_region(src, r)
        write_rank(src, r, full, st[r], regs[r])
    got = []
    for d in range(8):
        rp = plan.ranks[d]
        assert rp.planes_per_layer == 1
        assert rp.base.total_nbytes == dst.local_token_count(n, d % 4) * dst.token_nbytes
        g = empty_region(dst, 77)
        apply_segments({r: as_bytes(t) for r, t in regs.items()}, as_bytes(g), plan.segments(d))
        got.append(g)
    for d in range(4):
        assert torch.equal(got[d], got[d + 4])
        assert set(plan.ranks[d].src_ranks()) | set(plan.ranks[d + 4].src_ranks()) == {0, 1}  # replicas spread
    assert plan.total_nbytes == 2 * n * src.num_layers * src.token_nbytes  # each token once per DCP group


def test_mla_layer_subset():
    src, dst = _mla(2, layers=5, dtype="bfloat16"), _mla(4, 4, 1, layers=5, dtype="bfloat16")
    _check_case(src, dst, 40, seed=3, layers=range(1, 4))
    plan = plan_reshard(src, [list(range(3))] * 2, dst, [[0]] * 4, 40, layers=range(2, 3))
    assert plan.layer_segments(0, 2).total_nbytes == plan.ranks[0].nbytes_per_layer == 10 * 12 * 2


def test_mla_plan_speed_8k_tokens():
    """DeepSeek-V3's latent width (576) and 61 layers, decode TP 8 x DCP 8, fragmented tables."""
    src = KVLayout.mla(61, 576, "bfloat16", 64, tp_size=2, num_blocks=512)
    dst = KVLayout.mla(61, 576, "bfloat16", 64, tp_size=8, dcp_size=8, num_blocks=512)
    rng = np.random.default_rng(0)
    st = [rng.permutation(512)[:128].tolist()] * 2
    dt = [rng.permutation(512)[: dst.blocks_needed(8192, r)].tolist() for r in range(8)]
    plan = plan_reshard(src, st, dst, dt, 8192)
    assert plan.total_nbytes == 61 * 8192 * 576 * 2
    assert all(plan.ranks[d].base.total_nbytes == 1024 * 576 * 2 for d in range(8))


def test_plan_scales_names_a_holder_of_every_decode_head():
    """fp8 scales of decode rank d's heads come from prefill ranks holding that head (any replica); MLA's two
    groups from any rank; a DCP source is refused, a model-dtype layout has none."""
    from kv_transfer.plan import plan_scales

    src = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, dtype="float8_e4m3fn", block_size=4, tp_size=3)
    dst = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, dtype="float8_e4m3fn", block_size=4, tp_size=9, dcp_size=3)
    for d in range(9):
        (cands,) = plan_scales(src, dst, d)
        head = dst.kv_heads_of_rank(d).start
        assert cands == [(head, 0)], (d, cands)
    wide = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, dtype="float8_e4m3fn", block_size=4, tp_size=9)
    assert plan_scales(wide, src, 1) == [[(3, 0), (4, 0), (5, 0)]]
    mla = KVLayout.mla(2, 24, "float8_e5m2", 4, tp_size=2)
    assert plan_scales(mla, KVLayout.mla(2, 24, "float8_e5m2", 4, tp_size=4, dcp_size=4), 3) == [
        [(0, 0), (1, 0)],
        [(0, 1), (1, 1)],
    ]
    plain = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, dtype="float32", block_size=4)
    assert plan_scales(plain, plain, 0) == []
    with pytest.raises(ValueError, match="without DCP"):
        plan_scales(dst, src, 0)
