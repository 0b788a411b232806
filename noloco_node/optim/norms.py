"""Squared norms and distances of whole parameters in float64, without float64 copies of them.

The outer round's error statistics (sync/snapshot.py, optim/compress.py) measure what the wire
changes in float64: whole-tensor `.double()` copies, their difference and its square took 32 bytes
per element of the tensor at once, 8.4 GB for a 128k x 2048 embedding or LM head, on the device of a
volunteer's 24 GB card. Here a chunk of elements at a time: at most one float64 chunk lives.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 1 << 22
"""Elements per float64 chunk (32 MiB)."""


def squared_distance(x: Tensor, y: Tensor | None = None, *, chunk: int = CHUNK) -> float:
    """sum((x - y)^2), or sum(x^2) without `y`, accumulated in float64, one sync at the end."""
    flat = x.reshape(-1)
    other = None if y is None else y.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk].double()
        if other is not None:  # not in place: for a float64 x, .double() is x itself
            part = part - other[start : start + chunk].to(part.device)
        total += torch.dot(part, part)
    return float(total)
