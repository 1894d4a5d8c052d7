"""Retry policy: exponential backoff with jitter, on UNAVAILABLE only, never after a Generate stream delivered a
message (tokens are never re-sent), always within the call's deadline."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import grpc

from pdserve.client.errors import DeadlineExceededError, PdserveError


@dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` counts the first try (1 = never retry). The n-th retry waits
    ``min(max_backoff_s, initial_backoff_s * multiplier ** (n - 1))``, randomised by +/- ``jitter`` (a fraction)."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2
    retry_codes: frozenset[grpc.StatusCode] = field(default_factory=lambda: frozenset({grpc.StatusCode.UNAVAILABLE}))

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError("backoffs must be >= 0, multiplier >= 1 and jitter in [0, 1]")

    def backoff(self, retry_number: int) -> float:
        """Seconds to wait before retry number ``retry_number`` (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(0, retry_number - 1))
        if self.jitter:
            base *= 1.0 + random.uniform(-self.jitter, self.jitter)
        return max(0.0, base)


NO_RETRY = RetryPolicy(max_attempts=1)


class Deadline:
    """An absolute deadline (monotonic clock) spanning every attempt of one call; None = no deadline."""

    def __init__(self, timeout: float | None) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self.timeout = timeout
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def expired(self) -> bool:
        r = self.remaining()
        return r is not None and r <= 0


class RetryState:
    """Decides, after a failed attempt, whether and how long to wait before the next one."""

    def __init__(self, policy: RetryPolicy, deadline: Deadline) -> None:
        self.policy = policy
        self.deadline = deadline
        self.attempt = 1

    def next_delay(self, err: PdserveError) -> float:
        """Seconds to sleep before retrying after ``err``; raises ``err`` (or DeadlineExceededError) when the call
        must not be retried."""
        if err.code not in self.policy.retry_codes or self.attempt >= self.policy.max_attempts:
            raise err
        delay = self.policy.backoff(self.attempt)
        left = self.deadline.remaining()
        if left is not None and left <= delay:
            raise DeadlineExceededError(
                f"deadline of {self.deadline.timeout:g}s exceeded while retrying after {self.attempt} attempt(s); "
                f"last error: {err.status_name}: {err.message}",
                request_id=err.request_id,
            ) from err
        self.attempt += 1
        return delay
