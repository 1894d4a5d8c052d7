"""The engine's KV-connector interface: how a pod moves KV in or out of its ranks' caches (after vLLM's
``kv_connector/v1/base.py``), so the engine calls documented hooks and carries typed metadata, never ``Any``.

Two sides:

* ``KVConnectorScheduler`` lives with the LLMEngine (the driver). Each step, between schedule and execute, the
  engine calls ``build_connector_meta(step)``; the ``KVConnectorMetadata`` it returns travels with the step to every
  rank inside ``StepInput``'s flat encoding (``KVConnectorMetadata.encode``: int64 words plus UTF-8 ids, no pickle).
* ``KVConnectorWorker`` lives on every rank, owned by that rank's ModelRunner (``runner.kv_connector``) and built
  there once from a picklable ``KVConnectorSpec`` (``LLMEngine.set_kv_connector``); it keeps its rank state as
  fields. For a step carrying metadata the runner calls ``start_load_kv(meta)`` before the forward pass,
  ``save_kv_layer(layer, meta)`` right after each layer wrote its KV, and ``wait_for_save(meta)`` after the step;
  steps without metadata call nothing (no cost on the decode hot path).

The driver reaches the workers only through named operations (``Executor.connector_call``): ``take_finished``,
``deliver``, ``receive``, ``checksums``, ``abort``, ``info`` and ``close`` (``KVConnectorWorker.OPS``), each run on
every rank, results in rank order. ``receive`` is the asynchronous ``deliver`` (vLLM's ``load_kv_async``): it
returns at once and ``take_finished`` reports each rank's share once it landed. Role implementations (the prefill
publisher, the decode puller) live with their services.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.scheduler import ScheduledStep


@dataclass(frozen=True)
class KVSaveRequest:
    """A request whose prompt KV becomes complete in this step (every layer of it is written by the step)."""

    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]  # the same on every rank (no DCP on pods that save)
    num_tokens: int


@dataclass(frozen=True)
class KVConnectorMetadata:
    """What the scheduler side tells every rank's worker side about one step."""

    saves: tuple[KVSaveRequest, ...] = field(default_factory=tuple)

    def encode(self) -> bytes:
        """[n, (num_tokens, n_blocks, len lease id, len request id) * n, block ids...] as int64, then the ids."""
        head: list[int] = [len(self.saves)]
        blocks: list[int] = []
        text = bytearray()
        for s in self.saves:
            lid, rid = s.lease_id.encode(), s.request_id.encode()
            head += [s.num_tokens, len(s.block_ids), len(lid), len(rid)]
            blocks += s.block_ids
            text += lid + rid
        return torch.tensor(head + blocks, dtype=torch.int64).numpy().tobytes() + bytes(text)

    @staticmethod
    def decode(data: bytes) -> "KVConnectorMetadata":
        (n,) = struct.unpack_from("<q", data)
        head = struct.unpack_from(f"<{4 * n}q", data, 8)
        n_blocks = sum(head[1::4])
        blocks = struct.unpack_from(f"<{n_blocks}q", data, 8 + 32 * n)
        at, bt = 8 + 32 * n + 8 * n_blocks, 0
        saves = []
        for i in range(n):
            num_tokens, nb, nl, nr = head[4 * i : 4 * i + 4]
            lid, rid = data[at : at + nl].decode(), data[at + nl : at + nl + nr].decode()
            at += nl + nr
            saves.append(KVSaveRequest(lid, rid, tuple(blocks[bt : bt + nb]), num_tokens))
            bt += nb
        return KVConnectorMetadata(tuple(saves))


class KVConnectorScheduler(ABC):
    """Driver side: the LLMEngine calls it once per scheduled step, on the engine thread."""

    @abstractmethod
    def build_connector_meta(self, step: "ScheduledStep") -> KVConnectorMetadata | None:
        """Metadata for this step's workers, or None when no rank has anything to do for it."""


class KVConnectorWorker(ABC):
    """Rank side: one instance per rank, built in the rank's process from a KVConnectorSpec.

    Hooks run on the rank's forward thread and must never raise (record failures and report them through
    ``take_finished``). Named operations run when the driver asks (``Executor.connector_call``)."""

    OPS = frozenset({"take_finished", "deliver", "receive", "checksums", "abort", "info", "close"})

    def __init__(self, runner: "ModelRunner") -> None:
        self.runner = runner

    # --- hooks, called by ModelRunner.execute for a step whose metadata is not None ---
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:  # noqa: B027 - an optional hook: doing nothing is right
        """Before the forward pass."""

    def save_kv_layer(self, layer: int, meta: KVConnectorMetadata) -> None:  # noqa: B027 - an optional hook: doing nothing is right
        """Right after layer ``layer`` wrote this step's KV into the rank's cache."""

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:  # noqa: B027 - an optional hook: doing nothing is right
        """After the forward pass."""

    # --- named operations, run on every rank at the driver's request ---
    def info(self) -> Any:
        """Start-up facts the driver needs (e.g. this rank's endpoint)."""
        return None

    def take_finished(self) -> Any:
        """What finished on this rank since the last call (e.g. freed leases, failed saves)."""
        return None

    def deliver(self, *args: Any) -> Any:
        """Write KV that arrives from elsewhere into this rank's cache."""
        raise NotImplementedError(f"{type(self).__name__} does not receive KV")

    def receive(self, *args: Any) -> Any:
        """Start writing KV that arrives from elsewhere off the caller's thread; take_finished reports it."""
        raise NotImplementedError(f"{type(self).__name__} does not receive KV")

    def checksums(self, *args: Any) -> Any:
        """Checksums of KV this rank holds (a prefill rank: its share over a request's blocks, for the hand-off)."""
        raise NotImplementedError(f"{type(self).__name__} does not checksum KV")

    def abort(self, ids: list[str], reason: str) -> None:  # noqa: B027 - an optional hook: doing nothing is right
        """Give up on these transfers."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and registrations (the rank is about to stop or drop the connector)."""


@dataclass(frozen=True)
class KVConnectorSpec:
    """Which worker implementation every rank builds, and its picklable constructor arguments."""

    cls: type[KVConnectorWorker]
    args: tuple = ()

    def build(self, runner: "ModelRunner") -> KVConnectorWorker:
        return self.cls(runner, *self.args)
