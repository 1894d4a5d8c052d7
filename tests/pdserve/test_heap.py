"""pdserve/heap.py: a service's startup objects leave the collector's reach, what it allocates later does not."""

from __future__ import annotations

import json
import subprocess
import sys

from e2e_helpers import REPO, service_env

# Run in a process of its own: frozen objects are never collected, which a test process must not inherit.
_SCRIPT = r"""
import gc, json
import grpc, torch  # what every pdserve service imports at start
from pdserve.heap import freeze_startup_heap

class Node:
    def __init__(self):
        self.me = self  # a cycle: only the cyclic collector frees it

startup = [Node() for _ in range(5000)]
tracked_before = len(gc.get_objects())
frozen = freeze_startup_heap("test")
tracked_after = len(gc.get_objects())  # the permanent generation is not listed
later = Node()
later_tracked = any(o is later for o in gc.get_objects())
del later
gc.collect()
print(json.dumps({"before": tracked_before, "frozen": frozen, "after": tracked_after,
                  "later_tracked": later_tracked, "count": gc.get_freeze_count()}))
"""


def test_freeze_moves_the_startup_heap_out_of_collections_and_keeps_tracking_new_objects():
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["frozen"] >= 0.99 * r["before"] > 5000  # everything alive at the freeze (the 5,000 cycles too)
    assert r["after"] < 1000  # a collection now walks what was allocated since, not the startup heap
    assert r["later_tracked"]  # new objects are still collected as usual
    assert r["count"] == r["frozen"]
