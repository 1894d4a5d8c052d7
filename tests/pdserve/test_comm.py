"""Shared-memory collectives (pdserve/engine/comm.py) against gloo on the same inputs, in real rank processes:
odd sizes, 3 and 9 ranks, four dtypes, tensors and byte strings larger than a slot (sent in pieces). Reductions
are the left-to-right sum in rank order, so every rank holds the same bits."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp
from barrier_helpers import dead_pid, two_rank_barrier
from comm_worker import run_rank

from pdserve.engine.comm import init_groups, plan_groups
from pdserve.engine.shm import RankFailure, ShmRegion, shm_supported
from pdserve.net import free_port

# slow: up to nine rank processes
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shm_supported() is not None, reason=f"shared memory: {shm_supported()}"),
]


@pytest.mark.parametrize("n", [3, 9])
def test_collectives_match_gloo(n):
    # One group with room for every case, one whose slot (256 B) forces the larger cases through in pieces.
    big, _, end = plan_groups(n, 1, 64 << 10, 0)
    small, _, end2 = plan_groups(n, 1, 256, 0)
    small = type(small)(end, small.ranks, small.slot_bytes)
    region = ShmRegion(end + end2)
    init_groups(region, [big, small])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, n, region, [big, small], port, q)) for r in range(n)]
    for p in procs:
        p.start()
    region.close_fd()
    results = sorted(q.get(timeout=600) for _ in range(n))
    for p in procs:
        p.join(timeout=60)
    problems = [f"rank {r}: {msg}" for r, msgs, _ in results for msg in msgs]
    assert not problems, "\n".join(problems[:20])
    digests = {d for _, _, d in results}
    assert len(digests) == 1, "ranks hold different all-reduce results"


def test_a_count_left_by_a_killed_rank_does_not_release_a_later_phase():
    """A rank killed between posting a barrier's semaphore and taking its count back leaves that count behind: the
    next phase on that semaphore must wait for the rank itself (and name it as gone), not pass on the stale count
    with the dead rank's slots unwritten."""
    b0, _ = two_rank_barrier()
    gone = dead_pid()
    b0.expect(1, gone)  # as the executor names a spawned rank's pid
    b0._lib.sem_post(b0._sems[b0.next_phase])  # the count rank 1 left behind
    with pytest.raises(RankFailure, match=f"TP rank 1 \\(pid {gone}\\) exited during a collective"):
        b0.wait(10.0, "a collective")
