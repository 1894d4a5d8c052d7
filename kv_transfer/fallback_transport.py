"""Plain TCP data path: the same re-shard plan, bytes streamed over the control connection.

Prefill gathers the requested segments (checked against the lease's blocks, under a read pin) into
chunks of ``chunk_bytes`` (big segments go straight from the region) and streams them; decode
receives the whole layer group into a staging buffer and only then scatters it into its region,
so a refused or broken read writes nothing. Flow control: one layer-group request in flight per
endpoint, TCP's window does the rest (the sender blocks when the reader stops reading, up to an
I/O timeout).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kv_transfer.control import recv_exact_into
from kv_transfer.plan import RankPlan
from kv_transfer.publisher import Publisher
from kv_transfer.puller import BasePuller, _Source
from kv_transfer.transport import KVHandoff, TransferUnavailable

__all__ = ["TcpPublisher", "TcpPuller"]


class TcpPublisher(Publisher):
    """Prefill side of the fallback: ``Publisher`` already serves TCP reads."""

    name = "tcp"


class TcpPuller(BasePuller):
    name = "tcp"

    def __init__(self, *args, staging_limit: int = 64 << 20, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.staging_limit = staging_limit
        self._tls = threading.local()  # a staging buffer per pulling thread (pulls may run concurrently)

    def _read(self, src: _Source, handoff: KVHandoff, rp: RankPlan, layers: range, deadline: float) -> int:
        src.path = src.path or "tcp"
        # Bound the staging buffer: split a big group into sub-groups of at most staging_limit bytes.
        per_layer = rp.planes_per_layer * src.base.total_nbytes
        step = max(1, self.staging_limit // max(per_layer, 1))
        return sum(
            self._read_group(src, handoff, rp, range(a, min(a + step, layers.stop)), deadline)
            for a in range(layers.start, layers.stop, step)
        )

    def _read_group(self, src: _Source, handoff: KVHandoff, rp: RankPlan, layers: range, deadline: float) -> int:
        plane_bytes = src.base.total_nbytes
        planes = rp.planes_per_layer
        total = plane_bytes * planes * len(layers)
        if total == 0:
            return 0
        buf = getattr(self._tls, "staging", None)
        if buf is None or buf.nbytes < total:
            buf = self._tls.staging = np.empty(total, np.uint8)
        staging = buf.data
        pos = 0

        def on_frame(msg, sock, plen, frame_deadline) -> None:
            nonlocal pos
            if pos + plen > total:
                raise ConnectionResetError("peer sent more bytes than the plan asks for")
            recv_exact_into(sock, staging[pos : pos + plen], min(frame_deadline, deadline + 1.0))
            pos += plen

        if time.monotonic() > deadline:
            raise TransferUnavailable(f"lease {handoff.lease_id}: transfer deadline passed")
        src.client.stream(self._msg("read", handoff, layers=[layers.start, layers.stop]), src.wire, on_frame)
        if pos != total:
            raise TransferUnavailable(f"lease {handoff.lease_id}: short read from {src.session.endpoint}")
        # Only now touch the region: everything for the group arrived.
        for i, layer in enumerate(layers):
            for kv in range(planes):
                plane = rp.plane_index(layer, kv)
                start = (planes * i + kv) * plane_bytes
                self.region_bytes.scatter(
                    buf[start : start + plane_bytes],
                    src.base.dst_offset + plane * rp.dst_plane_nbytes,
                    src.base.nbytes,
                )
        return total
