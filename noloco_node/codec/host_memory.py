"""Host memory a received tensor lands in. For a stage on a GPU it is pinned, from torch's caching
host allocator: the bytes arrive in the buffer the device then copies from by DMA, where a pageable
buffer cost the compute thread a second host copy (`pin_memory()`) of every hop before it.

The buffer must stay a tensor of that allocator (a view of it, never a `torch.frombuffer` over its
memory): the allocator records the device copy's stream against the block and does not hand the
block out again until the copy is done, which it can only do for its own tensors.
"""

from __future__ import annotations

import logging

import numpy
import torch
from torch import Tensor

log = logging.getLogger(__name__)
_warned = False


def host_empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype, *, pinned: bool) -> Tensor:
    """An uninitialised host tensor: pinned when asked and the system can pin it, else pageable."""
    if pinned:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:  # no accelerator, or the pinned pool is exhausted
            _warn_once(exc)
    return torch.empty(shape, dtype=dtype)


def receive_buffer(nbytes: int, *, pinned: bool) -> tuple[memoryview, Tensor | None]:
    """(a writable byte view to collect a payload into, the pinned uint8 tensor that owns it or
    None). Pageable buffers come from numpy: torch.empty maps fresh pages for a large tensor each
    time (a fault per page), and a bytearray zero-fills every payload first."""
    if pinned:
        owner = host_empty((nbytes,), torch.uint8, pinned=True)
        if owner.is_pinned():
            return memoryview(owner.numpy()), owner
    return memoryview(numpy.empty(nbytes, dtype=numpy.uint8)), None


def _warn_once(exc: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("received tensors go to pageable host memory: pinning failed (%s)", exc)
