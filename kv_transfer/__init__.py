"""KV cache transfer between prefill and decode pods (NIXL/UCX data path, TCP fallback).

Modules: ``layout`` (one side's KV layout as byte arithmetic), ``plan`` (pure re-shard planner),
``transport`` (interfaces, handoff, typed errors), ``lease`` (prefill-side lease table),
``control`` (TCP control channel), ``publisher`` / ``puller`` (transport-independent sides),
``region`` (byte access to a rank's KV region, for the copying paths), ``staging`` (staged reads: whole source
blocks in a few big runs, scattered locally), ``nixl_transport`` / ``fallback_transport`` (the two data paths),
``factory`` (pick one).

Services use: ``make_publisher`` (prefill), ``make_puller`` (decode, one per rank), ``KVHandoff``.
"""

from kv_transfer.factory import make_publisher, make_puller, nixl_available
from kv_transfer.layout import KVLayout
from kv_transfer.lease import new_lease_id
from kv_transfer.plan import ReshardPlan, Segments, plan_reshard
from kv_transfer.transport import (
    BadTransferRequest,
    Endpoint,
    HandshakeTimeout,
    KVHandoff,
    KVPublisher,
    KVPuller,
    KVTransferError,
    LeaseExpired,
    PullResult,
    TransferCancelled,
    TransferUnavailable,
)

__all__ = [
    "BadTransferRequest",
    "Endpoint",
    "HandshakeTimeout",
    "KVHandoff",
    "KVLayout",
    "KVPublisher",
    "KVPuller",
    "KVTransferError",
    "LeaseExpired",
    "PullResult",
    "ReshardPlan",
    "Segments",
    "TransferCancelled",
    "TransferUnavailable",
    "make_publisher",
    "make_puller",
    "new_lease_id",
    "nixl_available",
    "plan_reshard",
]
