"""A two-rank shared-memory barrier in one test process, and a peer that has died: the setup the barrier tests of
test_comm.py (shm.py's Barrier) and test_decode_native.py (its C++ copy) share."""

from __future__ import annotations

import subprocess

from pdserve.engine.shm import Barrier, ShmRegion


def two_rank_barrier(ranks: tuple[int, int] = (0, 1)) -> tuple[Barrier, Barrier]:
    """Group ranks 0 and 1 of a fresh barrier over a region of their own (members' TP ranks `ranks`), initialised
    and both registered with this process's pid: two threads of one process can stand for the two ranks."""
    region = ShmRegion(Barrier.nbytes(2))
    b0, b1 = Barrier(region, 0, 2, 0, list(ranks)), Barrier(region, 0, 2, 1, list(ranks))
    b0.init()
    b0.register()
    b1.register()
    return b0, b1


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped: what a rank killed mid-step leaves behind."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid
