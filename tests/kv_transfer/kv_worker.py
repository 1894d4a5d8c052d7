"""A prefill-side test process: hosts publishers, driven by commands over a multiprocessing Pipe.

Runs in its own (spawned) process so every transfer in the tests crosses a process boundary.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from typing import Any

from kv_reference import empty_region, full_kv, write_rank

from kv_transfer.factory import make_publisher, make_puller
from kv_transfer.layout import KVLayout
from kv_transfer.transport import KVHandoff


def _serve(conn: Any, env: dict[str, str] | None = None) -> None:
    os.environ.update(env or {})  # before any NIXL agent: UCX reads its settings when a backend is created
    logging.basicConfig(level=logging.WARNING)
    pubs: dict[str, Any] = {}
    freed: dict[str, list[tuple[str, str]]] = {}
    ready_times: dict[str, list[float]] = {}
    while True:
        cmd, a = conn.recv()
        try:
            if cmd == "start":  # a publisher for some prefill ranks of a layout, with the request's KV written
                key, layout = a["key"], KVLayout.from_dict(a["layout"])
                full = full_kv(layout, a["num_tokens"], a["seed"])
                regions = {}
                for r in a["ranks"]:
                    regions[r] = empty_region(layout, 100 + r)
                    write_rank(layout, r, full, a["tables"][r], regions[r])
                freed[key] = []
                pubs[key] = make_publisher(
                    layout,
                    regions,
                    backend=a["backend"],
                    on_free=lambda lid, rid, why, k=key: freed[k].append((lid, why)),
                    lease_timeout_s=a.get("lease_timeout_s", 30.0),
                    pin_ttl_s=a.get("pin_ttl_s", 10.0),
                    ucx_transports=a.get("ucx_transports"),
                )
                conn.send(("ok", pubs[key].name))
            elif cmd == "publish":
                pub = pubs[a["key"]]
                lid = pub.publish(
                    a["request_id"],
                    {r: a["tables"][r] for r in pub.regions},
                    a["num_tokens"],
                    lease_id=a["lease_id"],
                    layers_ready=a.get("layers_ready", 0),
                )
                conn.send(("ok", pub.handoff(lid).to_json()))
            elif cmd == "stream":  # layers become ready one by one, ``delay`` apart
                pub, lid, delay = pubs[a["key"]], a["lease_id"], a["delay"]
                ready_times[lid] = []

                def run(pub=pub, lid=lid, delay=delay) -> None:
                    for n in range(1, pub.layout.num_layers + 1):
                        time.sleep(delay)
                        ready_times[lid].append(time.monotonic())
                        pub.set_layers_ready(lid, n)

                threading.Thread(target=run, daemon=True).start()
                conn.send(("ok", None))
            elif cmd == "scribble":  # the freed blocks get reused: another request's KV overwrites them
                for t in pubs[a["key"]].regions.values():
                    t.fill_(a["value"])
                conn.send(("ok", None))
            elif cmd == "ready_times":
                conn.send(("ok", list(ready_times.get(a["lease_id"], []))))
            elif cmd == "freed":
                conn.send(("ok", {k: list(v) for k, v in freed.items()}))
            elif cmd == "counts":
                conn.send(("ok", {k: dict(p.leases.freed_counts) for k, p in pubs.items()}))
            elif cmd == "pid":
                conn.send(("ok", os.getpid()))
            elif cmd == "exit":
                for p in pubs.values():
                    p.close()
                conn.send(("ok", None))
                return
            else:
                conn.send(("err", f"unknown command {cmd}"))
        except Exception as e:  # report, keep serving
            conn.send(("err", repr(e)))


class PrefillWorker:
    """Handle on a spawned prefill process."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, env), daemon=True)
        self.proc.start()

    def call(self, cmd: str, timeout: float = 30.0, **args: Any) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"prefill worker did not answer {cmd} in {timeout}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"prefill worker {cmd}: {value}")
        return value

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except Exception:
                pass
        self.kill()


def _decode_child(
    conn: Any,
    layout: dict,
    tables: list[list[int]],
    handoff: str,
    ucx_transports: str | None,
    env: dict[str, str],
    opts: dict[str, Any],
) -> None:
    os.environ.update(env)
    pullers = []
    try:
        lay = KVLayout.from_dict(layout)
        regions = [empty_region(lay, 500 + r) for r in range(lay.tp_size)]
        pullers = [
            make_puller(lay, r, regions[r], backend="nixl", ucx_transports=ucx_transports, **opts)
            for r in range(lay.tp_size)
        ]
        h = KVHandoff.from_json(handoff)
        results = [p.pull(h, tables[r], timeout_s=30) for r, p in enumerate(pullers)]
        # numpy, not tensors: a tensor would cross as a shared-memory handle this process takes away on exit
        conn.send(("ok", ([r.numpy() for r in regions], [res.transport for res in results])))
    except BaseException as e:  # reported to the test
        conn.send(("err", f"{type(e).__name__}: {e}"))
    finally:
        for p in pullers:
            p.close()


def pull_in_own_process(
    layout: KVLayout,
    tables: list[list[int]],
    handoff: KVHandoff,
    ucx_transports: str | None,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    **opts: Any,
) -> tuple[str, Any]:
    """Every decode rank's NIXL puller in a fresh spawned process (UCX's transport list is a per-process setting, so
    it must not leak into the test process): ("ok", (regions, transports)) or ("err", what failed)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_decode_child,
        args=(child, layout.to_dict(), tables, handoff.to_json(), ucx_transports, env or {}, opts),
        daemon=True,
    )
    proc.start()
    try:
        if not parent.poll(timeout):
            raise TimeoutError(f"decode process did not answer in {timeout}s")
        return parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
