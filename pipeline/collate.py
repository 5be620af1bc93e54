"""Batch building blocks shared by the kinds: allocation in shared memory, bit-packed masks.

A DataLoader worker hands each batch to the main process through shared memory. Allocating the
batch there from the start (and zeroing only its padding) spares a full copy; sending masks as
bits (8 to a byte) spares 7/8 of their bytes through shared memory, pinned memory and PCIe. The
last stage, after the device copy, unpacks them (on the GPU when the batch is there).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import get_worker_info

__all__ = ["empty", "pack_bits", "unpack_bits"]

_BITS = (128, 64, 32, 16, 8, 4, 2, 1)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor; in a DataLoader worker, already in shared memory."""
    tensor = torch.empty(shape, dtype=dtype)
    return tensor.share_memory_() if get_worker_info() is not None else tensor


def pack_bits(masks: np.ndarray) -> np.ndarray:
    """(..., w) bool -> (..., ceil(w / 8)) uint8, most significant bit first."""
    return np.packbits(masks, axis=-1)


def unpack_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of `pack_bits` for a tensor on any device: (..., ceil(width / 8)) uint8 -> (..., width) bool."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), axis=-1, count=width).view(np.bool_))
    bits = torch.tensor(_BITS, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) & bits) != 0).flatten(-2)[..., :width]
