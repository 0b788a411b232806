"""glibc allocator settings for large tensor traffic (transport.md: page faults dominate).

By default glibc serves big allocations with fresh mmaps and unmaps them on free, so every new
multi-MiB buffer is page-faulted again; raising the mmap and trim thresholds keeps freed heap
memory for reuse (1.5-8x on large-tensor paths here). The cost: RSS does not shrink after peaks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_allocator(mmap_threshold_bytes: int = 1 << 30, trim_threshold_bytes: int = 2**31 - 1) -> bool:
    """Apply the mallopt settings; returns False (and logs) where glibc is not available."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes) == 1
    except (OSError, AttributeError):
        log.debug("mallopt is not available (libc=%s); allocator left as is", name)
        return False
    return bool(ok)


def rss_mb(pid: int) -> float | None:
    """Resident memory of process `pid` in MiB, from /proc (Linux); None once it has exited
    (a zombie has no VmRSS), which a sampler polling a live process can always race into."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return None
