"""The engine thread both pods run: one thread owns the engine (rank 0's collectives must not interleave), other
threads reach it only through a command queue, and a wake nudges an idle loop.

``EngineThread`` holds the mechanics (start and report a start-up error, a command queue, wake, stop/join, the
dead-rank check); each pod's loop (prefill_svc/worker.py, decode_svc/engine_loop.py) holds its policy."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pdserve.pod.engine")

Command = Callable[[], object]  # what a command returns is dropped


def _noop() -> None:
    pass


class EngineThread:
    """run(thread) builds the engine, calls thread.ready() (or raises: start() re-raises it), then loops until
    thread.stopping, taking commands with run_commands()."""

    def __init__(self, name: str, run: Callable[["EngineThread"], None]) -> None:
        self._run_fn = run
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._ready = threading.Event()
        self.start_error: BaseException | None = None
        self.stopping = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    # --- any thread ---
    def start(self, timeout_s: float = 600.0) -> None:
        """Start the thread and wait until its engine is up; raises what building it raised."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"{self._thread.name} did not start within {timeout_s:.0f}s")
        if self.start_error is not None:
            raise self.start_error

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask the loop to end (it sees ``stopping`` after its current step) and wait for the thread."""
        self.stopping = True
        self.wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, cmd: Command) -> None:
        self._cmds.put(cmd)

    def wake(self) -> None:
        """Make an idle loop look again now (e.g. a KV lease was freed on another thread)."""
        self._cmds.put(_noop)

    # --- the engine thread ---
    def ready(self) -> None:
        self._ready.set()

    def run_commands(self, timeout_s: float = 0.0, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Run the queued commands, waiting up to timeout_s for the first; a command that raises is logged (or
        handed to on_error) and the rest still run."""
        try:
            cmd = self._cmds.get(timeout=timeout_s) if timeout_s > 0 else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                cmd()
            except Exception as e:
                if on_error is None:
                    log.exception("%s: command failed", self._thread.name)
                else:
                    on_error(e)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _main(self) -> None:
        try:
            self._run_fn(self)
        except BaseException as e:
            if not self._ready.is_set():  # reported by start()
                self.start_error = e
            else:
                log.exception("%s failed", self._thread.name)
        finally:
            self._ready.set()


def dead_ranks(executor: Any, grace_s: float = 0.0) -> list[tuple[int, int | None]]:
    """(rank, exit code) of the pod's spawned TP ranks that exited (cheap: a non-blocking waitpid per rank).

    grace_s: after a failed collective, wait up to this long for a dying rank to become reapable (its sockets
    close, resetting the peers, a moment before its exit can be waited for)."""
    procs = getattr(executor, "procs", [])
    deadline = time.monotonic() + grace_s
    while procs and all(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [(rank, p.exitcode) for rank, p in enumerate(procs, start=1) if not p.is_alive()]
