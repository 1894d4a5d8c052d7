"""Ports chosen ahead of binding (a cluster's endpoints, a rank group's store) without racing the kernel.

A port found free and bound later by another process can be taken in between. The kernel hands out ports for
``bind(0)`` and for outgoing connections from its ephemeral range, so a port chosen outside that range can only be
taken by another ``free_port`` caller (a random pick over thousands of ports), never by a socket opened meanwhile.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LINUX_DEFAULT_EPHEMERAL = (32768, 60999)
_LOWEST = 10000  # below: ports that well-known services tend to hold
_MIN_SPAN = 1000  # a narrower gap would make two pickers collide too often
_rng = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive)."""
    try:
        lo, hi = (int(x) for x in _EPHEMERAL_RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return _LINUX_DEFAULT_EPHEMERAL


def _candidate_spans() -> list[tuple[int, int]]:
    lo, hi = ephemeral_range()
    spans = [(_LOWEST, lo - 1), (hi + 1, 65535)]
    return [(a, b) for a, b in spans if b - a + 1 >= _MIN_SPAN]


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", avoid: set[int] | None = None) -> int:
    """A port of ``host`` that binds now, outside the ephemeral range where the system leaves room for that."""
    avoid = avoid or set()
    spans = _candidate_spans()
    for _ in range(200 if spans else 0):
        a, b = _rng.choice(spans)
        port = _rng.randint(a, b)
        if port not in avoid and _binds(host, port):
            return port
    for _ in range(100):  # no room outside the ephemeral range: the kernel's pick
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError(f"no free port found on {host}")
