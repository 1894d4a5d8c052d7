"""Shared memory between the rank processes of one pod on one host: a region and a sleeping barrier over it.

The region is an anonymous memfd: it has no name in /dev/shm, it reaches spawned ranks as a duplicated file
descriptor (multiprocessing's DupFd), and the kernel frees it when the last process holding it exits, SIGKILL
included, so nothing can be left behind.

The barrier is built from glibc's process-shared semaphores and a futex word in the region (ctypes, Linux):
arriving is an atomic increment, the rank that completes a phase publishes it in the futex word and wakes the
sleepers, and waiting ranks sleep in the kernel instead of spinning, since a pod's ranks may outnumber its cores."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import time
from multiprocessing import reduction

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # process-shared (not FUTEX_PRIVATE_FLAG): the word lives in a shared mapping
_SEM_BYTES = 32  # sizeof(sem_t) on 64-bit glibc
LINE = 64  # every shared word gets its own cache line


class RankFailure(RuntimeError):
    """A rank of the group died, stopped or stopped answering: the group's collectives are broken for good."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libc() -> ctypes.CDLL | None:
    if _SYS_FUTEX is None or not os.path.exists("/proc/self"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        for name in ("sem_init", "sem_post", "sem_trywait", "sem_getvalue", "syscall"):
            getattr(libc, name)
    except (OSError, AttributeError):
        return None
    vp, ci = ctypes.c_void_p, ctypes.c_int
    libc.sem_init.argtypes, libc.sem_init.restype = [vp, ci, ctypes.c_uint], ci
    libc.sem_post.argtypes, libc.sem_post.restype = [vp], ci
    libc.sem_trywait.argtypes, libc.sem_trywait.restype = [vp], ci
    libc.sem_getvalue.argtypes, libc.sem_getvalue.restype = [vp, ctypes.POINTER(ci)], ci
    libc.syscall.restype = ctypes.c_long
    return libc


_libc = _load_libc()


def shm_supported() -> str | None:
    """None when shared-memory collectives work on this host, else why not (the caller falls back to gloo)."""
    if _libc is None:
        return f"needs Linux with glibc semaphores and futexes on x86_64 or aarch64 (this is {platform.machine()})"
    if not hasattr(os, "memfd_create"):
        return "needs os.memfd_create (Linux >= 3.17)"
    return None


class ShmRegion:
    """A shared anonymous region; pickling it (only while spawning a process) hands the child the same memory."""

    def __init__(self, size: int, fd: int | None = None) -> None:
        self.size = size
        if fd is None:
            fd = os.memfd_create("pdserve-ranks", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd: int | None = fd
        # The mapping lives as long as the process: views of it (tensors, ctypes words) are handed out freely.
        self.mm = memoryview(mmap.mmap(fd, size))
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    def __reduce__(self):
        if self.fd is None:
            raise RuntimeError("a ShmRegion can be sent to a process only while its creator still holds the fd")
        return _rebuild_region, (self.size, reduction.DupFd(self.fd))

    def close_fd(self) -> None:
        """Once every rank process has its copy of the fd; the memory stays mapped."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _rebuild_region(size: int, dupfd) -> ShmRegion:
    return ShmRegion(size, dupfd.detach())


def proc_state(pid: int) -> str | None:
    """The one-letter state of a process from /proc (R, S, D, T, t, Z, ...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    at = stat.rindex(b")") + 2  # the command name in parentheses may itself hold spaces or ")"
    return stat[at : at + 1].decode()


class Barrier:
    """A reusable barrier among ``n`` processes over ``Barrier.nbytes(n)`` bytes of a region.

    Phase s uses semaphore s % 2. Every rank posts it and reads its value; whoever reads n stores s in the futex
    word and wakes the sleepers (several may: the store is idempotent). After passing, each rank takes one count
    back, so the semaphore is at zero again before anyone can post it for phase s + 2 (which needs every rank to
    have arrived at s + 1, after its take-back); a count left by a rank killed in between is caught by the ranks'
    arrival words. A waiting rank sleeps on the futex word in slices; between slices it checks the abort word and
    its peers' processes (dead, or stopped longer than ``stall_s``)."""

    SLICE_S = 0.25

    def __init__(
        self, region: ShmRegion, offset: int, n: int, rank: int, ranks: list[int], spin: int = 0, stall_s: float = 3.0
    ) -> None:
        assert _libc is not None, shm_supported()
        self._lib: ctypes.CDLL = _libc
        self.n, self.rank, self.ranks, self.spin, self.stall_s = n, rank, ranks, spin, stall_s
        self._region = region  # its words are raw addresses into the mapping: keep it mapped while this lives
        base = region.address + offset
        self._gen = ctypes.c_uint32.from_address(base)
        self._abort = ctypes.c_uint32.from_address(base + LINE)
        self._sems = (base + 2 * LINE, base + 3 * LINE)
        self._sleepers = base + 4 * LINE  # ranks inside futex_wait: the waker skips the syscall when there are none
        self._fence = base + 5 * LINE
        self._pids = (ctypes.c_int64 * n).from_address(base + 6 * LINE)
        self._arrived = (ctypes.c_int64 * n).from_address(base + 6 * LINE + _words(n))
        self._seq = 0
        self._val = ctypes.c_int()
        self._slice = _Timespec(0, int(self.SLICE_S * 1e9))
        self._gen_ptr = ctypes.c_void_p(base)
        self._val_ref = ctypes.byref(self._val)
        self._slice_ref = ctypes.byref(self._slice)
        self._stopped_since: dict[int, float] = {}

    @staticmethod
    def nbytes(n: int) -> int:
        return 6 * LINE + 2 * _words(n)

    def init(self) -> None:
        """Once, by the creator, before any rank uses it."""
        self._gen.value = 0
        self._abort.value = 0
        for s in (*self._sems, self._sleepers, self._fence):
            if self._lib.sem_init(s, 1, 0) != 0:
                raise OSError(ctypes.get_errno(), "sem_init failed")

    def register(self) -> None:
        """Each rank, once at start: its pid lets peers tell a dead or stopped rank from a slow one."""
        self._pids[self.rank] = os.getpid()

    def expect(self, index: int, pid: int) -> None:
        """The spawner names a peer's pid before it registers, so a peer that dies while starting is noticed."""
        self._pids[index] = pid

    def abort(self) -> None:
        self._abort.value = 1
        self._wake()

    def _wake(self) -> None:
        self._lib.syscall(_SYS_FUTEX, self._gen_ptr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    @property
    def seq(self) -> int:
        """Waits this rank has made; a native caller (ShmComm.native) reads it and sets it back after its own."""
        return self._seq

    @seq.setter
    def seq(self, value: int) -> None:
        self._seq = value

    def native(self) -> list[int]:
        """[address, n, rank, -, -, spin, seq, timeout ms, stall ms] for csrc/decode_step.cpp's copy of wait()."""
        return [self._gen_ptr.value or 0, self.n, self.rank, 0, 0, self.spin, self._seq, 0, int(self.stall_s * 1000)]

    @property
    def next_phase(self) -> int:
        """0 or 1: the phase of the next wait(), which picks the slot set a collective writes."""
        return (self._seq + 1) & 1

    @property
    def aborted(self) -> bool:
        return bool(self._abort.value)

    def wait(self, timeout_s: float | None, what: str = "a collective", watch: tuple[int, ...] | None = None) -> None:
        """Arrive and wait until all n ranks have; timeout_s None waits as long as the peers live. watch: the
        group ranks whose death or stop ends the wait (default: every peer)."""
        self._seq += 1
        seq = self._seq & 0xFFFFFFFF
        sem = self._sems[self._seq & 1]
        self._arrived[self.rank] = self._seq
        self._lib.sem_post(sem)
        if self._complete(sem):
            self._release(seq)
        elif self._gen.value != seq:
            self._sleep_until(seq, sem, timeout_s, what, watch)
        self._lib.sem_trywait(sem)

    def _complete(self, sem: int) -> bool:
        """n posts, and every rank's own arrival word says this phase: a rank killed between its post and its
        take-back leaves a count behind, which must not release a later phase it never reached."""
        self._lib.sem_getvalue(sem, self._val_ref)
        return self._val.value >= self.n and min(self._arrived[:]) >= self._seq

    def _release(self, seq: int) -> None:
        self._gen.value = seq
        # A locked instruction orders the store above before the load below (a sleeper does the mirror image).
        self._lib.sem_post(self._fence)
        self._lib.sem_trywait(self._fence)
        self._lib.sem_getvalue(self._sleepers, self._val_ref)
        if self._val.value:
            self._wake()

    def _sleep_until(
        self, seq: int, sem: int, timeout_s: float | None, what: str, watch: tuple[int, ...] | None
    ) -> None:
        gen = self._gen
        for _ in range(self.spin):
            if gen.value == seq:
                return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._lib.sem_post(self._sleepers)
            cur = gen.value
            if cur != seq:
                self._lib.syscall(_SYS_FUTEX, self._gen_ptr, _FUTEX_WAIT, cur, self._slice_ref, None, 0)
            self._lib.sem_trywait(self._sleepers)
            if gen.value == seq:
                return
            if self._complete(sem):  # the last arrival read a stale arrival word (weak memory order): release now
                self._release(seq)
                return
            if self._abort.value:
                raise RankFailure(f"{what} was aborted: the pod is stopping its ranks")
            self.check_peers(what, watch)
            if deadline is not None and time.monotonic() > deadline:
                late = self._missing()
                raise RankFailure(
                    f"{what} timed out after {timeout_s:.0f} s waiting for TP rank(s) {late}", late[0] if late else None
                )

    def _missing(self) -> list[int]:
        return [self.ranks[i] for i in range(self.n) if self._arrived[i] < self._seq]

    def check_peers(self, what: str = "a collective", watch: tuple[int, ...] | None = None) -> None:
        """Raise RankFailure if a watched peer exited or has been stopped (SIGSTOP, a debugger) for stall_s."""
        now = time.monotonic()
        for i in range(self.n) if watch is None else watch:
            pid = self._pids[i]
            if i == self.rank or pid == 0:
                continue
            state = proc_state(pid)
            if state in (None, "Z", "X"):
                raise RankFailure(f"TP rank {self.ranks[i]} (pid {pid}) exited during {what}", self.ranks[i])
            if state in ("T", "t"):
                since = self._stopped_since.setdefault(pid, now)
                if now - since > self.stall_s:
                    raise RankFailure(
                        f"TP rank {self.ranks[i]} (pid {pid}) has been stopped for {now - since:.1f} s during {what}",
                        self.ranks[i],
                    )
            else:
                self._stopped_since.pop(pid, None)


def spin_for(ranks_on_host: int) -> int:
    """Spin iterations before sleeping: only where every rank has a core of its own."""
    return 2000 if ranks_on_host <= len(os.sched_getaffinity(0)) else 0


def _words(n: int) -> int:
    """Bytes of n int64 words, rounded up to whole cache lines."""
    return -(-n * 8 // LINE) * LINE
