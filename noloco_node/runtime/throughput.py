"""What a node actually sustains, measured, for its record: routing weights follow it (SWARM's
stochastic wiring), and `status` marks the stage that limits the swarm.

Sampled at every heartbeat from counters the node keeps anyway, smoothed with an exponential
moving average so one slow window does not swing the traffic:
- capacity: sequences per second of compute-thread time (what the stage could do if never idle;
  a slower device or a contended CPU shows up here),
- throughput: sequences per wall-clock second (what it did),
- busy: microbatches in flight / the in-flight window,
- hop_s: seconds per outgoing Forward call (the link to the next stage),
- link_mbit_s: the median bandwidth measured to this node's peers (runtime/link_estimates.py,
  fed by every transfer; the same estimates set its deadlines).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from noloco_node.runtime.link_estimates import LinkEstimates


@dataclass
class _Ewma:
    alpha: float
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value


class ThroughputMeter:
    def __init__(self, *, alpha: float = 0.3, clock=time.monotonic, links: LinkEstimates | None = None) -> None:
        self.clock = clock
        self.links = links or LinkEstimates()
        self._capacity, self._throughput = _Ewma(alpha), _Ewma(alpha)
        self._busy, self._hop = _Ewma(alpha), _Ewma(alpha)
        # (time, sequences, compute busy seconds): from creation, so the first heartbeat measures
        self._last: tuple[float, int, float] | None = (clock(), 0, 0.0)

    def sample(self, *, sequences: int, busy_s: float, in_flight: int, window: int) -> None:
        """Called once per heartbeat with the running totals."""
        now = self.clock()
        self._busy.add(min(1.0, in_flight / window) if window else 0.0)
        if self._last is not None:
            then, seq_then, busy_then = self._last
            done, computed_s, wall_s = sequences - seq_then, busy_s - busy_then, now - then
            if done > 0 and computed_s > 0:
                self._capacity.add(done / computed_s)
            if wall_s > 0:
                self._throughput.add(done / wall_s)
        self._last = (now, sequences, busy_s)

    def observe_hop(self, seconds: float) -> None:
        self._hop.add(seconds)

    def record_fields(self) -> dict[str, float]:
        """capacity and throughput (sequences/s), busy (0..1), hop_s, link_mbit_s; 0 = not measured yet."""
        return {
            "capacity": round(self._capacity.value or 0.0, 4),
            "throughput": round(self._throughput.value or 0.0, 4),
            "busy": round(min(1.0, self._busy.value or 0.0), 4),
            "hop_s": round(self._hop.value or 0.0, 5),
            "link_mbit_s": round(self.links.link_mbit_s(), 3),
        }


def routing_weights(capacities: Iterable[float]) -> list[float]:
    """A next hop's weight is its measured capacity; a replica not measured yet (0) counts as the
    mean of those that are, and with no measurement at all every replica weighs the same."""
    capacities = list(capacities)
    known = [c for c in capacities if c > 0]
    default = sum(known) / len(known) if known else 1.0
    return [c if c > 0 else default for c in capacities]


def weakest_stage(capacities: list[list[float]]) -> int:
    """`join --stage auto`: a stage with no replica first; then, when every replica has measured
    its capacity, the stage whose replicas together sustain the least; else the stage with the
    fewest replicas. Ties go to the lowest index."""
    if all(caps and all(c > 0 for c in caps) for caps in capacities):
        return min(range(len(capacities)), key=lambda s: (sum(capacities[s]), s))
    return min(range(len(capacities)), key=lambda s: (len(capacities[s]), s))


def limiting_stage(capacity_by_stage: dict[int, list[float]]) -> int | None:
    """The stage whose replicas together sustain the least (None until every stage is measured)."""
    totals = {s: sum(caps) for s, caps in capacity_by_stage.items()}
    if not totals or any(t <= 0 for t in totals.values()):
        return None
    return min(totals, key=lambda s: (totals[s], s))
