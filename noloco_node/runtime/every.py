"""How often a node's heartbeat chores look at the swarm, and the clock that spaces them."""

from __future__ import annotations

import time

# Heartbeat chores that look at the swarm, at most this often (a heartbeat runs them when due: with
# the default 10 s heartbeat, every heartbeat; tests beat every second).
TOUCH_PERIOD_S = 5.0  # re-dial initial peers we lost (a restarted bootstrap is found within it)
LOOK_IDLE_S = 5.0  # look at our neighbouring stages while we make no progress
LOOK_BUSY_S = 30.0  # ... and while we do


class Every:
    """`due(period_s)` is true at most once per period (the first call always)."""

    def __init__(self) -> None:
        self._last = float("-inf")

    def due(self, period_s: float) -> bool:
        now = time.monotonic()
        if now - self._last < period_s:
            return False
        self._last = now
        return True
