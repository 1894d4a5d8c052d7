"""How a request's prompt KV gets into a decode pod's blocks.

A KVSource is a small picklable object that is sent to every rank of the pod, to the rank's KV-connector worker
``DecodeKVConnector`` (pdserve/engine/kv_connector.py, its ``deliver`` operation); on each rank
``write_rank(conn, block_table)`` writes exactly that rank's share (its DCP tokens, its KV heads) into the rank's
cache at the blocks the pod reserved for it, and returns the bytes written.

TransferKVSource is the one implementation: a kv_transfer KVPuller on each rank, held by the rank's connector
(``puller.pull(handoff, block_table)``), reading from whichever prefill pod published the KV.

Two ways to run it (the pod's ``--kv-load``):
- ``deliver`` (sync): every rank writes its share inside the driver's call; the engine thread waits for it.
- ``receive`` (async, the default): every rank starts its share on a transfer thread of its own process and
  returns at once; ``take_finished`` hands each rank's finished shares to the driver, which admits a request only
  when every rank reported (decode_svc/kv_loads.py), so the running batch never waits for a transfer.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import grpc

from pdserve.engine.kv_connector import KVConnectorSpec, KVConnectorWorker
from pdserve.errors import ServiceError
from pdserve.sched import background_thread

if TYPE_CHECKING:  # pragma: no cover
    from kv_transfer.layout import KVLayout
    from pdserve.engine.executor import Executor
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.security import TLSConfig


class KVDeliveryError(ServiceError):
    """Some rank could not write its share of the prompt KV (ABORTED unless the cause says otherwise);
    ``prefill_pod``: where the KV was to come from ("" when unknown)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.ABORTED, prefill_pod: str = "") -> None:
        super().__init__(code, message)
        self.prefill_pod = prefill_pod


@runtime_checkable
class KVSource(Protocol):
    @property
    def num_tokens(self) -> int: ...  # read-only: sources may be frozen dataclasses

    def write_rank(
        self, conn: "DecodeKVConnector", block_table: list[int], cancelled: threading.Event | None = None
    ) -> int | tuple[int, list[int]]:
        """Runs on every rank (in the rank's process): copy this rank's tokens/heads into block_table; the bytes
        written, with this rank's share of the per-block checksums when the source carries checksums. Once
        ``cancelled`` is set, stop before the next write (raising KVDeliveryError, CANCELLED)."""
        ...


# --- one kv_transfer KVPuller per rank, created in the rank's own process ---


@dataclass(frozen=True)
class TransferKVSource:
    """``puller_factory(runner)`` builds the rank's KVPuller once per connector (it registers runner.kv_cache);
    ``handoff_json`` is a kv_transfer KVHandoff. Any kv_transfer error is raised with its status code."""

    handoff_json: str
    num_tokens: int
    puller_factory: Callable[["ModelRunner"], Any]
    timeout_s: float | None = None
    checksums: tuple[int, ...] = ()  # per logical block of checksum_block_tokens, from the prefill pod; () = none
    checksum_block_tokens: int = 0
    prefill_pod: str = ""

    def keepalive(self, conn: "DecodeKVConnector") -> None:
        """Renew the prefill lease while the request waits for decode blocks (rank 0, in the pod's process)."""
        from kv_transfer.transport import KVHandoff

        conn.puller(self.puller_factory).renew(KVHandoff.from_json(self.handoff_json))

    def write_rank(
        self, conn: "DecodeKVConnector", block_table: list[int], cancelled: threading.Event | None = None
    ) -> int | tuple[int, list[int]]:
        from kv_transfer.transport import KVHandoff, KVTransferError

        runner = conn.runner
        puller = conn.puller(self.puller_factory)
        try:
            handoff = KVHandoff.from_json(self.handoff_json)
            nbytes = int(puller.pull(handoff, block_table, timeout_s=self.timeout_s, cancelled=cancelled).nbytes)
        except Exception as e:
            code = e.code if isinstance(e, KVTransferError) else grpc.StatusCode.ABORTED
            raise KVDeliveryError(f"KV transfer failed on rank {runner.ps.tp_rank}: {e}", code) from e
        if not self.checksums:
            return nbytes
        from pdserve.pod.kv_checksum import partial_checksums

        return nbytes, partial_checksums(
            puller.layout,
            runner.ps.tp_rank,
            runner.kv_cache,
            block_table,
            self.num_tokens,
            self.checksum_block_tokens,
            runner.kv_scales,
        )


@dataclass(frozen=True)
class PullerFactory:
    """Builds a decode rank's kv_transfer puller over its cache (picklable; called in the rank's process)."""

    kv_layout: "KVLayout"  # the decode pod's cache (GQA or MLA), as kv_transfer sees each rank's region
    backend: str = "auto"  # kv_transfer.factory: "auto" (NIXL if usable, else TCP), "nixl", "tcp"
    auth_token: str = ""  # the cluster token presented to prefill pods' KV endpoints ("" = none)
    tls: "TLSConfig | None" = None  # the pod's TLS settings, used to dial those endpoints
    ucx_transports: str | None = None  # UCX_TLS of a NIXL puller (None: UCX's choice)

    @classmethod
    def for_engine(
        cls,
        engine: "LLMEngine",
        backend: str = "auto",
        auth_token: str = "",
        tls: "TLSConfig | None" = None,
        ucx_transports: str | None = None,
    ) -> "PullerFactory":
        from pdserve.pod.convert import kv_layout_for_model

        cfg = engine.config
        layout = kv_layout_for_model(
            engine.model_config,
            str(engine.executor.kv_cache.dtype),
            cfg.block_size,
            tp_size=cfg.tensor_parallel_size,
            dcp_size=cfg.decode_context_parallel_size,
            interleave=cfg.dcp_kv_cache_interleave_size,
            num_blocks=cfg.num_kv_blocks,
        )
        return cls(layout, backend, auth_token, tls, ucx_transports)

    def layout(self) -> "KVLayout":
        return self.kv_layout

    def __call__(self, runner: "ModelRunner") -> Any:
        from kv_transfer.factory import make_puller

        return make_puller(
            self.layout(),
            runner.ps.tp_rank,
            runner.kv_cache,
            backend=self.backend,
            auth_token=self.auth_token,
            tls=self.tls,
            ucx_transports=self.ucx_transports,
            scales=runner.kv_scales,
        )


RankShare = int | tuple[int, list[int]] | BaseException  # one rank's outcome: bytes (and checksums), or why not


class DecodeKVConnector(KVConnectorWorker):
    """A decode rank's KV-connector worker: writes arriving prompt KV (``deliver`` in the caller's call, ``receive``
    on the rank's transfer threads) and holds the rank's pullers."""

    # Concurrent receives per rank: a publisher that stopped answering holds one thread until its timeout, and
    # the others keep landing other requests' KV meanwhile.
    TRANSFER_THREADS = 4
    # How far below the rank's engine thread its transfer threads run (nice): a transfer takes the core's idle time
    # and a small share of a busy one, so the running batch's steps keep their pace (docs/performance.md).
    TRANSFER_NICE = 10

    def __init__(self, runner: "ModelRunner") -> None:
        super().__init__(runner)
        self.pullers: dict[Any, Any] = {}  # puller factory -> its puller over this rank's cache
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._receiving: dict[str, threading.Event] = {}  # load id -> its cancel flag, while its thread runs
        self._finished: dict[str, RankShare] = {}  # load id -> outcome, until take_finished hands it over

    def puller(self, factory: Callable[["ModelRunner"], Any]) -> Any:
        p = self.pullers.get(factory)
        if p is None:
            p = self.pullers[factory] = factory(self.runner)
        return p

    def deliver(self, source: KVSource, tables: list[list[int]]) -> int | tuple[int, list[int]]:
        """Write this rank's share of source (tables: one block table per DCP rank); the bytes written."""
        return source.write_rank(self, tables[self.runner.ps.dcp_rank])

    def receive(self, load_id: str, source: KVSource, tables: list[list[int]]) -> None:
        """Start writing this rank's share of source on a transfer thread and return at once; the outcome comes
        out of a later take_finished under load_id."""
        if self._pool is None:
            name = f"pdkv-recv{self.runner.ps.tp_rank}"
            self._pool = ThreadPoolExecutor(
                self.TRANSFER_THREADS,
                thread_name_prefix=name,
                initializer=background_thread,
                initargs=(self.TRANSFER_NICE,),
            )
        cancelled = threading.Event()
        with self._lock:
            self._receiving[load_id] = cancelled
        self._pool.submit(self._receive, load_id, source, tables[self.runner.ps.dcp_rank], cancelled)

    def _receive(self, load_id: str, source: KVSource, table: list[int], cancelled: threading.Event) -> None:
        share: RankShare
        try:
            share = source.write_rank(self, table, cancelled)
        except BaseException as e:  # reported to the driver with the request, never lost in the pool
            share = e
        with self._lock:
            self._receiving.pop(load_id, None)
            self._finished[load_id] = share

    def take_finished(self) -> dict[str, RankShare]:
        """Receives that ended on this rank since the last call: load id -> bytes (and checksums) or exception.
        A load given up (abort) is reported too, once its thread stopped writing: only then may its blocks go."""
        with self._lock:
            done, self._finished = self._finished, {}
        return done

    def abort(self, ids: list[str], reason: str) -> None:
        """Stop these receives at their next layer group (the pull tells the publisher it gave up)."""
        with self._lock:
            flags = [self._receiving.get(i) for i in ids]
        for f in flags:
            if f is not None:
                f.set()

    def close(self) -> None:
        with self._lock:
            flags = list(self._receiving.values())
        for f in flags:
            f.set()
        if self._pool is not None:  # a pull stuck on a frozen publisher must not hold the rank's shutdown
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for p in self.pullers.values():
            try:
                p.close()
            except Exception:  # closing is best effort: the rank is going away
                pass
        self.pullers.clear()


def decode_connector(executor: "Executor") -> DecodeKVConnector:
    """Rank 0's DecodeKVConnector, built on every rank on first use."""
    conn = executor.runner.kv_connector
    if conn is None:
        errs = [
            r for r in executor.start_kv_connector(KVConnectorSpec(DecodeKVConnector)) if isinstance(r, BaseException)
        ]
        if errs:
            executor.connector_call("close")
            raise KVDeliveryError(f"starting the KV connector failed: {errs[0]!r}")
        conn = executor.runner.kv_connector
    assert isinstance(conn, DecodeKVConnector)
    return conn


def rank_failure(rank: int, error: BaseException) -> KVDeliveryError:
    """What a rank's failed share fails the request with (its own KVDeliveryError, or one naming the rank)."""
    if isinstance(error, KVDeliveryError):
        return error
    return KVDeliveryError(f"rank {rank} could not write its KV: {type(error).__name__}: {error}")


def deliver(executor: "Executor", source: KVSource, tables: list[list[int]]) -> tuple[list[int], float]:
    """Have every rank write its share (tables: one block table per DCP rank). Returns (bytes per rank, seconds);
    raises KVDeliveryError naming the first rank that failed."""
    t0 = time.perf_counter()
    decode_connector(executor)
    results = executor.connector_call("deliver", source, tables)
    for rank, r in enumerate(results):
        if isinstance(r, BaseException):
            raise rank_failure(rank, r)
    expected = getattr(source, "checksums", ())
    if expected:
        check_checksums(source, [r[1] for r in results])
    return [int(r[0]) if isinstance(r, tuple) else int(r) for r in results], time.perf_counter() - t0


def check_checksums(source: Any, parts: list[list[int]]) -> None:
    """Compare what the ranks read with the prefill pod's checksums; DATA_LOSS naming the pod and block if not."""
    from pdserve.pod.kv_checksum import combine, first_mismatch

    bad = first_mismatch(source.checksums, combine(parts))
    if bad is not None:
        b = source.checksum_block_tokens
        raise KVDeliveryError(
            f"KV read from prefill pod {source.prefill_pod or '(unnamed)'} failed its checksum at block {bad} (tokens "
            f"{bad * b}..{min(source.num_tokens, (bad + 1) * b) - 1}): the bytes read are not the bytes published; "
            f"the request is refused and its KV freed",
            grpc.StatusCode.DATA_LOSS,
        )
