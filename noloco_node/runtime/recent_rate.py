"""A counter's rate over the last minute, for what a person reads as "now": a mean since start
still showed an idle node at 500 tok/s fourteen minutes after its last step (a newcomer's audit
of a finished run), and the swarm page's chart drew it training."""

from __future__ import annotations

import time
from collections import deque

RECENT_WINDOW_S = 60.0


class RecentRate:
    """Sampled when read (at least a second apart, so a flood of reads keeps few samples): the
    rise of the counter over the last `window_s` seconds, per second; 0 once it stopped rising a
    window ago."""

    def __init__(self, start_total: int = 0, *, window_s: float = RECENT_WINDOW_S, clock=time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._samples: deque[tuple[float, int]] = deque([(clock(), start_total)])

    def rate(self, total: int) -> float:
        now = self.clock()
        if now - self._samples[-1][0] >= 1.0:
            self._samples.append((now, total))
        # Keep one sample at or before the window's start, to measure the whole window.
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        since, then = self._samples[0]
        return max(0.0, (total - then) / (now - since)) if now > since else 0.0
