"""Byte access to a rank's KV region tensor, for the copying (non-NIXL) paths.

CPU regions are viewed as a flat numpy uint8 array (zero copy). CUDA regions go through per-segment
torch copies: correct but slow, and only a fallback of the fallback (NIXL reads VRAM directly).
"""

from __future__ import annotations

import numpy as np
import torch

from kv_transfer.layout import KVLayout, dtype_name


def check_region(layout: KVLayout, region: torch.Tensor, what: str) -> None:
    if tuple(region.shape) != layout.region_shape():
        raise ValueError(f"{what}: region shape {tuple(region.shape)} != layout {layout.region_shape()}")
    if dtype_name(region.dtype) != layout.dtype:
        raise ValueError(f"{what}: region dtype {region.dtype} != layout dtype {layout.dtype}")
    if not region.is_contiguous():
        raise ValueError(f"{what}: region must be one contiguous tensor (registered once)")


class RegionBytes:
    def __init__(self, region: torch.Tensor) -> None:
        self.tensor = region
        self.is_cuda = region.is_cuda
        self._u8 = region.view(-1).view(torch.uint8)
        self._np = None if self.is_cuda else self._u8.numpy()

    @property
    def nbytes(self) -> int:
        return self._u8.numel()

    def numpy(self) -> np.ndarray:
        if self._np is None:
            raise TypeError("numpy view of a CUDA region")
        return self._np

    def read_into(self, offset: int, n: int, out: np.ndarray) -> None:
        if self._np is not None:
            out[:n] = self._np[offset : offset + n]
        else:
            out[:n] = self._u8[offset : offset + n].cpu().numpy()

    def gather(self, offsets: np.ndarray, nbytes: np.ndarray, out: np.ndarray) -> None:
        """Pack ``[off, off+n)`` rows back to back into ``out``."""
        pos = 0
        if self._np is not None:
            src = self._np
            for o, n in zip(offsets.tolist(), nbytes.tolist()):
                out[pos : pos + n] = src[o : o + n]
                pos += n
            return
        for o, n in zip(offsets.tolist(), nbytes.tolist()):
            out[pos : pos + n] = self._u8[o : o + n].cpu().numpy()
            pos += n

    def scatter(self, packed: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray) -> None:
        """Inverse of gather."""
        pos = 0
        if self._np is not None:
            dst = self._np
            for o, n in zip(offsets.tolist(), nbytes.tolist()):
                dst[o : o + n] = packed[pos : pos + n]
                pos += n
            return
        host = torch.from_numpy(packed)
        for o, n in zip(offsets.tolist(), nbytes.tolist()):
            self._u8[o : o + n].copy_(host[pos : pos + n])
            pos += n

    def view(self, offset: int, n: int) -> memoryview:
        """Zero-copy bytes of a CPU region range (for sending without a staging copy)."""
        return self.numpy()[offset : offset + n].data
