"""One rank of tests/pdserve/test_comm.py: runs every collective over shared memory and over gloo on the same
inputs and reports what disagrees (spawned: module level so that it can be pickled)."""

from __future__ import annotations

import datetime
import hashlib
import traceback

import torch
import torch.distributed as dist

from pdserve.engine.comm import ShmComm, ShmGroupSpec, TorchComm

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
SIZES = (1, 7, 577, 1001)  # 1001 float32 words do not fit the small group's slot: it goes in pieces
# gloo sums in another order; bf16 keeps 8 bits of mantissa, so 9 terms of magnitude ~3 may differ by a few ulps
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 0.15}


def inputs(rank: int, dtype: torch.dtype, shape: tuple[int, ...], case: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def in_rank_order(xs: list[torch.Tensor]) -> torch.Tensor:
    out = xs[0].clone()
    for x in xs[1:]:
        out += x
    return out


def run_rank(rank: int, n: int, region, groups: list[ShmGroupSpec], port: int, q) -> None:
    problems: list[str] = []
    digest = hashlib.sha256()
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, n, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, world_size=n, rank=rank, timeout=datetime.timedelta(seconds=120))
        gloo = TorchComm(dist.group.WORLD, n, rank)
        for spec in groups:
            shm = ShmComm(region, spec, rank, timeout_s=60.0)
            case = 0
            for dtype in DTYPES:
                for numel in SIZES:
                    case += 1
                    where = f"slot {spec.slot_bytes} B, {dtype}, {numel} elements"
                    xs = [inputs(r, dtype, (numel,), case) for r in range(n)]
                    mine = xs[rank]
                    got = shm.all_reduce(mine.clone())
                    want = gloo.all_reduce(mine.clone())
                    digest.update(
                        got.view(torch.uint8).numpy().tobytes()
                        if dtype != torch.bfloat16
                        else got.view(torch.int16).numpy().tobytes()
                    )
                    if dtype.is_floating_point:
                        if not torch.equal(got, in_rank_order(xs)):
                            problems.append(f"all_reduce is not the rank-order sum ({where})")
                        if not torch.allclose(got.double(), want.double(), rtol=TOL[dtype], atol=TOL[dtype]):
                            problems.append(f"all_reduce differs from gloo ({where})")
                    elif not torch.equal(got, want):
                        problems.append(f"all_reduce differs from gloo ({where})")
                    shape = (3, numel)
                    x2 = inputs(rank, dtype, shape, case + 500)
                    if not torch.equal(shm.all_gather(x2), gloo.all_gather(x2)):
                        problems.append(f"all_gather differs from gloo ({where})")
                    x3 = inputs(rank, dtype, (2 * n, numel), case + 900)
                    all3 = [inputs(r, dtype, (2 * n, numel), case + 900) for r in range(n)]
                    rs = shm.reduce_scatter(x3, dim=0)
                    if rs.shape != (2, numel) or not torch.equal(rs, in_rank_order(all3)[2 * rank : 2 * rank + 2]):
                        problems.append(f"reduce_scatter is not this rank's slice of the rank-order sum ({where})")
                    rs_g = gloo.reduce_scatter(x3.clone(), dim=0)
                    tol = TOL.get(dtype, 0)
                    if not torch.allclose(rs.double(), rs_g.double(), rtol=tol, atol=tol):
                        problems.append(f"reduce_scatter differs from gloo ({where})")
                    rs1 = shm.reduce_scatter(inputs(rank, dtype, (numel, n), case + 1300), dim=1)
                    if rs1.shape != (numel, 1):
                        problems.append(f"reduce_scatter along dim 1 has shape {tuple(rs1.shape)} ({where})")
            payload = bytes(range(256)) * (3 + rank)  # longer than the small slot: several pieces
            got_b = shm.broadcast_bytes(payload if rank == 0 else None, "test broadcast", 60.0)
            if got_b != bytes(range(256)) * 3:
                problems.append(f"broadcast_bytes lost bytes (slot {spec.slot_bytes} B)")
            gathered = shm.gather_bytes(payload, "test gather")
            if rank == 0 and gathered != [bytes(range(256)) * (3 + r) for r in range(n)]:
                problems.append(f"gather_bytes lost bytes (slot {spec.slot_bytes} B)")
            if rank != 0 and gathered is not None:
                problems.append("gather_bytes returned data on a rank other than 0")
        dist.destroy_process_group()
    except Exception:
        problems.append(traceback.format_exc())
    q.put((rank, problems, digest.hexdigest()))
