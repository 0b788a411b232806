"""Inner-loop integrity: bounds on received tensors that follow the stage's own running
statistics, and the check that keeps non-finite values out of theta, phi, m and Adam's state.

Finite is not enough. Activations of +-3e38 are finite, but the next RMSNorm squares them to inf
and every gradient after that is NaN: one such microbatch used to destroy a replica for good. So
a received tensor must also have an RMS within `factor` of the median RMS of the recent tensors
this stage accepted in the same direction, and no element above `max_abs`. Pure torch; knows
nothing of networking.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

import torch
from torch import Tensor


# Below this, a sum of squares cannot overflow float32 (largest finite ~3.4e38).
_SAFE_SUM_OF_SQUARES = 1e37


def peak_abs(tensor: Tensor) -> float:
    """max |x| in one pass (aminmax, no |x| temporary): NaN when any element is NaN, inf when any
    is infinite. A received activation is checked with it on the node's event loop, so it is kept
    to a pass over the payload: `abs().max()` allocated and read a copy of it."""
    if tensor.numel() == 0:
        return 0.0
    low, high = (float(v) for v in torch.aminmax(tensor.detach()))
    if math.isnan(low) or math.isnan(high):
        return math.nan
    return max(-low, high)


def tensor_rms(tensor: Tensor, peak: float | None = None) -> float:
    """Root mean square, without overflowing on values near float32's limit (+-3e38 squares to inf).
    `peak` is max |x| when the caller has it already. A bfloat16 tensor is read as it is (its
    products accumulate in float32), not widened first."""
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0.0
    if peak is None:
        peak = peak_abs(flat)
    if not math.isfinite(peak) or peak == 0.0:
        return peak
    if peak * peak * n < _SAFE_SUM_OF_SQUARES:
        return math.sqrt(float(torch.dot(flat, flat)) / n)
    scaled = flat.to(torch.float32) / peak
    return peak * math.sqrt(float(torch.dot(scaled, scaled)) / n)


class RunningBounds:
    """Accepts a tensor when its largest element is within `max_abs` and, once `min_samples`
    tensors have been accepted, its RMS within [median / factor, median * factor] of the last
    `window` accepted ones. The median (not the max) so that an attacker must own most of the
    window to drag the bounds, and a growing RMS (training) moves them along."""

    def __init__(self, *, factor: float, max_abs: float, window: int = 64, min_samples: int = 8) -> None:
        if factor <= 1.0:
            raise ValueError(f"factor must be > 1, got {factor}")
        self.factor, self.max_abs, self.min_samples = factor, max_abs, min_samples
        self.recent: deque[float] = deque(maxlen=window)
        self.refused = 0

    def check(self, tensor: Tensor) -> str | None:
        """None if acceptable (and then counted into the window), else why not."""
        peak = peak_abs(tensor)
        if not math.isfinite(peak):
            return self._refuse("payload holds non-finite values")
        if peak > self.max_abs:
            return self._refuse(f"payload holds |x| = {peak:.3g}, above this node's limit {self.max_abs:.3g}")
        rms = tensor_rms(tensor, peak)
        if len(self.recent) >= self.min_samples:
            median = statistics.median(self.recent)
            low, high = median / self.factor, median * self.factor
            if median > 0 and not low <= rms <= high:
                return self._refuse(
                    f"payload RMS {rms:.3g} is outside [{low:.3g}, {high:.3g}] "
                    f"({self.factor:g}x around the median of the last {len(self.recent)} accepted)"
                )
        self.recent.append(rms)
        return None

    def _refuse(self, reason: str) -> str:
        self.refused += 1
        return reason


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every floating-point tensor holds only finite values. One flag per tensor, kept on
    its device, and one read of them all: on a GPU, a read per tensor would stall the host on the
    device once per tensor. (The inner step checks its weights with one norm: optim/inner.py.)"""
    flags: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        if t.is_floating_point():
            flags.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(group).all()) for group in flags.values())


def repair_weights(
    params: dict[str, torch.nn.Parameter], phi: dict[str, Tensor] | None, adam_state: dict
) -> str | None:
    """Called when a stage's weights are found non-finite: theta <- phi (the last slow weights,
    which only ever take validated values) and Adam's moments for any parameter whose state is
    not finite are dropped. Returns what was done ("phi"), or None when there is no finite phi to
    restore from (the weights stay as they are, and the worker drops every microbatch they spoil)."""
    if phi is None or not all_finite(phi.values()):
        return None
    with torch.no_grad():
        for name, param in params.items():
            param.data.copy_(phi[name])  # all of theta: a finite-looking tensor may have taken part in the fault
            state = adam_state.get(param)
            if state and not all_finite(v for v in state.values() if isinstance(v, Tensor)):
                del adam_state[param]
    return "phi"
