"""KV hand-off of a prefill pod: one kv_transfer publisher per TP rank process, fed layer by layer.

Every rank of the pod (rank 0 in the engine's process, ranks 1..N-1 in the executor's spawned processes) owns its KV
region, so every rank runs its own publisher over it: ``PrefillKVPublisher``, the pod's KV-connector worker
(pdserve/engine/kv_connector.py), built on every rank by ``LLMEngine.set_kv_connector``. The worker's connector
scheduler lists, for each step, the requests whose *last* prompt chunk runs in that step (``LeaseStart``, a
``KVSaveRequest``); the typed metadata travels with the step to every rank, and each rank's ``save_kv_layer`` publishes
those leases after layer 0 and marks layer i+1 ready right after layer i wrote its KV. Earlier chunks wrote all their
layers in earlier steps, so "layers [0, n) ready" is exact for the whole prompt.

A publisher frees a lease (decode done, TTL, abort) by calling ``on_free`` on one of its threads; the rank records it,
and the engine thread collects the records (rank 0 directly, other ranks through the connector's ``take_finished``).
The engine's blocks go back only when every rank's publisher has let go of the lease.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.transport import Endpoint, KVHandoff
from pdserve.engine.kv_connector import KVConnectorMetadata, KVConnectorSpec, KVConnectorWorker, KVSaveRequest

if TYPE_CHECKING:
    from pdserve.security import TLSConfig

log = logging.getLogger("prefill_svc.kv")


LeaseStart = KVSaveRequest  # a lease to publish on every rank: its request's prompt KV completes in this step


@dataclass(frozen=True)
class RankKVSpec:
    transport: str  # "auto" | "nixl" | "tcp"
    layout: dict[str, Any]  # KVLayout.to_dict() of the pod
    host: str
    lease_timeout_s: float
    auth_token: str = ""  # the cluster token decode pods must prove they hold ("" = no check)
    tls: "TLSConfig | None" = None  # the pod's TLS: the KV control endpoints serve it too
    ucx_transports: str | None = None  # UCX_TLS of a NIXL publisher (None: UCX's choice)


def make_publisher(
    transport: str,
    layout: KVLayout,
    tp_rank: int,
    region: torch.Tensor,
    host: str,
    lease_timeout_s: float,
    on_free: Callable[[str, str, str], None],
    auth_token: str = "",
    tls: "TLSConfig | None" = None,
    ucx_transports: str | None = None,
    scales: torch.Tensor | None = None,
):
    """A kv_transfer publisher for one rank's region (NIXL when usable and asked for / "auto", else TCP); an fp8
    region's scales travel beside it."""
    from kv_transfer.factory import make_publisher as factory_make

    return factory_make(
        layout,
        {tp_rank: region},
        backend=transport,
        on_free=on_free,
        host=host,
        lease_timeout_s=lease_timeout_s,
        auth_token=auth_token,
        tls=tls,
        ucx_transports=ucx_transports,
        scales=None if scales is None else {tp_rank: scales},
    )


class PrefillKVPublisher(KVConnectorWorker):
    """One rank's publisher, its layer hook, and the record of leases it freed (drained by the engine thread)."""

    def __init__(self, runner: Any, spec: RankKVSpec) -> None:
        super().__init__(runner)
        self.tp_rank = runner.ps.tp_rank
        self.layout = KVLayout.from_dict(spec.layout)
        self.cuda = runner.kv_cache.is_cuda
        self._lock = threading.Lock()
        self._freed: list[tuple[str, str]] = []  # (lease id, reason)
        self._errors: list[tuple[str, int, str]] = []  # (lease id, layer, what failed)
        self.wake: Callable[[], None] | None = None  # rank 0: nudges the engine loop when a lease is freed
        self.region = runner.kv_cache
        self.scales = runner.kv_scales  # fp8 only
        self.publisher = make_publisher(
            spec.transport,
            self.layout,
            self.tp_rank,
            runner.kv_cache,
            spec.host,
            spec.lease_timeout_s,
            self._on_free,
            spec.auth_token,
            spec.tls,
            spec.ucx_transports,
            runner.kv_scales,
        )

    @property
    def endpoint(self) -> str:
        return str(self.publisher.endpoint)

    def info(self) -> tuple[str, str]:
        return self.endpoint, self.publisher.name

    def _on_free(self, lease_id: str, request_id: str, reason: str) -> None:
        with self._lock:
            self._freed.append((lease_id, reason))
        if self.wake is not None:
            self.wake()

    def save_kv_layer(self, layer: int, meta: KVConnectorMetadata) -> None:
        starts = meta.saves
        if not starts:
            return
        if self.cuda:  # the layer's KV writes must have landed before a reader is let in
            torch.cuda.current_stream().synchronize()
        for ls in starts:
            try:
                if layer == 0:
                    self.publisher.publish(
                        ls.request_id,
                        {self.tp_rank: list(ls.block_ids)},
                        ls.num_tokens,
                        lease_id=ls.lease_id,
                        layers_ready=1,
                    )
                else:
                    self.publisher.set_layers_ready(ls.lease_id, layer + 1)
            except Exception as e:  # never break the forward pass; the engine thread fails the request
                with self._lock:
                    self._errors.append((ls.lease_id, layer, repr(e)))

    def checksums(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """This rank's share of the request's per-block KV checksums (pdserve/pod/kv_checksum.py)."""
        from pdserve.pod.kv_checksum import partial_checksums

        if self.cuda:
            torch.cuda.current_stream().synchronize()
        return partial_checksums(
            self.layout, self.tp_rank, self.region, block_ids, num_tokens, self.layout.block_size, self.scales
        )

    def take_finished(self) -> tuple[list[tuple[str, str]], list[tuple[str, int, str]]]:
        with self._lock:
            freed, errors = self._freed, self._errors
            self._freed, self._errors = [], []
        return freed, errors

    def abort(self, lease_ids: list[str], reason: str) -> None:
        for lid in lease_ids:
            try:
                self.publisher.abort(lid, reason)
            except Exception:
                log.exception("rank %d: aborting kv lease %s failed", self.tp_rank, lid)

    def close(self) -> None:
        self.publisher.close()


class KVHost:
    """Engine-thread side of the pod's publishers (all calls from the engine thread)."""

    def __init__(
        self,
        engine: Any,
        layout: KVLayout,
        transport: str,
        host: str,
        lease_timeout_s: float,
        wake: Callable[[], None],
        auth_token: str = "",
        tls: "TLSConfig | None" = None,
        ucx_transports: str | None = None,
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.tp_size = layout.tp_size
        # token and TLS travel to every rank process inside the spec (pickled), not through the environment
        spec = RankKVSpec(transport, layout.to_dict(), host, lease_timeout_s, auth_token, tls, ucx_transports)
        results = engine.executor.start_kv_connector(KVConnectorSpec(PrefillKVPublisher, (spec,)))
        errs = [r for r in results if isinstance(r, Exception)]
        if errs:
            engine.executor.connector_call("close")  # the ranks that did start one
            raise RuntimeError(f"starting the KV publishers failed: {errs[0]!r}") from errs[0]
        self.endpoints = [Endpoint.parse(ep) for ep, _ in results]
        self.transport = "nixl" if all(name == "nixl" for _, name in results) else "tcp"
        rank0 = engine.executor.runner.kv_connector
        assert isinstance(rank0, PrefillKVPublisher)
        self.rank0 = rank0
        self.rank0.wake = wake

    def handoff(self, ls: LeaseStart) -> KVHandoff:
        return KVHandoff(
            ls.lease_id,
            ls.request_id,
            ls.num_tokens,
            self.layout,
            [list(ls.block_ids)] * self.tp_size,
            list(self.endpoints),
            self.transport,
        )

    def checksums(self, ls: LeaseStart) -> list[int]:
        """The per-block checksums of a lease's KV, over what every rank publishes (a collective over the pod)."""
        from pdserve.pod.kv_checksum import combine

        parts = self.engine.executor.connector_call("checksums", list(ls.block_ids), ls.num_tokens)
        for rank, p in enumerate(parts):
            if isinstance(p, BaseException):
                raise RuntimeError(f"rank {rank} could not checksum its KV: {p!r}") from p
        return combine(parts)

    def take(self, poll_others: bool) -> tuple[list[tuple[int, str, str]], list[tuple[int, str, int, str]]]:
        """(rank, lease id, reason) of leases freed since the last call, and (rank, lease id, layer, what) of
        publish errors.

        Rank 0 is read directly; other ranks only when poll_others (a collective over the pod)."""
        if poll_others and self.tp_size > 1:
            per_rank = self.engine.executor.connector_call("take_finished")
        else:
            per_rank = [self.rank0.take_finished()]
        freed, errors = [], []
        for rank, res in enumerate(per_rank):
            if isinstance(res, Exception):
                log.error("rank %d: collecting freed kv leases failed: %r", rank, res)
                continue
            f, e = res
            freed += [(rank, lid, reason) for lid, reason in f]
            errors += [(rank, lid, layer, what) for lid, layer, what in e]
        return freed, errors

    def abort(self, lease_ids: list[str], reason: str = "aborted") -> None:
        if lease_ids:
            self.engine.executor.connector_call("abort", list(lease_ids), reason)

    def close(self) -> None:
        self.engine.executor.connector_call("close")
