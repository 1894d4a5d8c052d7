"""Test helper: ``pdserve up`` in a subprocess, exactly as a user runs it.

    with UpProcess(["--model", path, "--port", "0", "--http-port", "0"], log_dir=tmp) as up:
        client = Client(up.router)
        ...
    # leaving the block sends SIGINT (Ctrl-C) and waits for `pdserve up` to stop everything

If the test process dies (a killed pytest), `pdserve up` gets SIGINT (PR_SET_PDEATHSIG) and stops its cluster, so
an interrupted test run leaves nothing behind either. ``descendants()`` lists every process below ``pdserve up``
(services, their TP ranks, the reaper) so a test can check that none survives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.cluster.supervisor import child_argv


class UpProcess:
    def __init__(
        self,
        args: list[str],
        *,
        log_dir: str | os.PathLike[str],
        env: dict[str, str] | None = None,
        startup_timeout: float = 900.0,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ready_file = self.log_dir / "ready.json"
        self.output = self.log_dir / "pdserve-up.out"
        self.args = args
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("HF_HUB_OFFLINE", "1")
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self._seen: dict[int, Any] = {}  # pid -> psutil.Process (is_running() notices a reused pid)

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def start(self, wait: bool = True) -> "UpProcess":
        self.ready_file.unlink(missing_ok=True)
        out = open(self.output, "ab")
        # its own session: the test's SIGINT goes to `pdserve up` alone, as Ctrl-C in its terminal would
        main_thread = threading.current_thread() is threading.main_thread()
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            *self.args,
            "--ready-file",
            str(self.ready_file),
            "--log-dir",
            str(self.log_dir),
            "--startup-timeout",
            str(self.startup_timeout),
        ]
        self.proc = subprocess.Popen(
            child_argv(cmd, os.getpid() if main_thread else None, deathsig="INT"),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        out.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> dict[str, Any]:
        assert self.proc is not None
        end = time.monotonic() + self.startup_timeout + 30
        while not self.ready_file.is_file():
            self.descendants()  # remember every pid seen, for the orphan check
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {self.proc.returncode} before it was ready:\n{self.tail()}")
            if time.monotonic() > end:
                raise TimeoutError(f"pdserve up not ready after {self.startup_timeout}s:\n{self.tail()}")
            time.sleep(0.2)
        self.info = json.loads(self.ready_file.read_text())
        self.descendants()
        return self.info

    def interrupt(self, timeout: float = 120.0) -> int:
        """Ctrl-C: SIGINT to `pdserve up`; returns its exit status."""
        assert self.proc is not None
        self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """Last resort for a test that failed: SIGKILL `pdserve up` and every process it started."""
        for pid in [*([self.proc.pid] if self.proc else []), *self.alive()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "UpProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.interrupt()
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            self.kill()

    # --- inspection --------------------------------------------------------------------------------------------
    @property
    def router(self) -> str:
        return self.info["router"]

    @property
    def http(self) -> str:
        return self.info["http"]

    def tail(self, n: int = 60) -> str:
        try:
            text = "\n".join(self.output.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            text = ""
        for log in sorted(self.log_dir.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            text += f"\n--- {log.name}\n" + "\n".join(lines)
        return text

    def descendants(self) -> list[int]:
        """Every live process below `pdserve up` now; also remembered for alive()."""
        import psutil

        if self.proc is None:
            return []
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        for k in kids:
            self._seen.setdefault(k.pid, k)
        return [k.pid for k in kids]

    def alive(self) -> list[int]:
        """Processes ever seen below `pdserve up` that still run (zombies do not count)."""
        import psutil

        out = []
        for pid, p in sorted(self._seen.items()):
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    def wait_all_gone(self, timeout: float = 10.0) -> list[int]:
        end = time.monotonic() + timeout
        while True:
            left = self.alive()
            if not left or time.monotonic() > end:
                return left
            time.sleep(0.1)
