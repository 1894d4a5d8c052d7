"""Restart policy of a local cluster: what the supervisor does when a service exits or stops answering.

Modelled on Kubernetes' pod restartPolicy and liveness probes:
- ``never``: a service that exits stays dead (``pdserve up`` then stops the cluster);
- ``on-failure``: a service that exits with a non-zero status (or by a signal) is started again with the same command
  line and port; one that exits 0 stays down;
- ``always``: any exit is followed by a restart.
Restarts are delayed by an exponential back-off (Kubernetes' CrashLoopBackOff: 10 s doubling up to 5 min, reset after
10 min of running; a local cluster starts in seconds, so the defaults here are scaled down), so a service that
crashes at startup does not spin. Under a policy other than ``never`` a liveness probe also runs: a service that
has answered once and then fails ``liveness_failures`` health checks in a row (a pod whose TP rank died reports
NOT_SERVING, which also counts as having answered; a frozen one does not answer) is killed, which counts as a failure
and so restarts it; so is a restarted service that answers nothing within ``startup_timeout_s`` (stuck while
starting).
"""

from __future__ import annotations

from dataclasses import dataclass

RESTART_MODES = ("never", "on-failure", "always")


@dataclass(frozen=True)
class RestartPolicy:
    mode: str = "never"
    backoff_s: float = 1.0  # delay before the first restart; doubled for each restart that follows quickly
    backoff_max_s: float = 30.0
    reset_after_s: float = 60.0  # a service that ran this long before exiting starts again from backoff_s
    liveness_period_s: float = 2.0
    liveness_timeout_s: float = 2.0
    liveness_failures: int = 3  # consecutive failed probes (after the service first served) that get it killed
    startup_timeout_s: float = 180.0  # a restarted service not SERVING by then is killed (Kubernetes' startupProbe)

    def __post_init__(self) -> None:
        if self.mode not in RESTART_MODES:
            raise ValueError(f"restart policy must be one of {', '.join(RESTART_MODES)}, got {self.mode!r}")
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise ValueError(f"need 0 <= backoff_s ({self.backoff_s}) <= backoff_max_s ({self.backoff_max_s})")
        for name in ("reset_after_s", "liveness_period_s", "liveness_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.liveness_failures < 1:
            raise ValueError(f"liveness_failures must be >= 1, got {self.liveness_failures!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "never"

    def restarts(self, exit_code: int) -> bool:
        """Whether a service that exited with ``exit_code`` (negative: killed by that signal) is started again."""
        return self.mode == "always" or (self.mode == "on-failure" and exit_code != 0)

    def delay(self, consecutive: int) -> float:
        """Back-off before restart number ``consecutive`` (1 for the first) of a crash loop."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, consecutive - 1))


@dataclass
class ServiceHealth:
    """The supervisor's record of one service under a restart policy."""

    started_at: float = 0.0
    consecutive: int = 0  # restarts in the current crash loop (reset once a run lasts reset_after_s)
    restart_at: float | None = None  # when the pending restart is due
    exit_code: int | None = None  # the exit that the pending restart follows
    reason: str = "exited"  # why: "exited", "liveness" (killed after failed probes) or "startup" (never served)
    delay_s: float = 0.0  # the back-off of the pending restart
    answered: bool = False  # has answered a probe since it was (re)started: liveness probes count from then
    probe_failures: int = 0
    next_probe: float = 0.0


@dataclass(frozen=True)
class RestartEvent:
    service: str
    exit_code: int
    reason: str  # "exited", "liveness" or "startup"
    delay_s: float
    at: float  # time.monotonic() of the restart
    pid: int
