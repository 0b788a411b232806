"""Fault injection at named points of a node, for tests and chaos experiments.

A spec is "POINT:ACTION[=SECONDS][@N|%P]":
  crash          the process exits at once with code 17 (no checkpoint, no goodbye: a SIGKILL)
  stall=S        the point sleeps S seconds (peers see a node that stopped answering)
  delay=S        the same sleep, meant to be shorter than the peers' deadlines
  error          the operation at that point fails (raises InjectedFault)
  poison[=X]     send_snapshot: the outer snapshot we send carries NaN (or our fast weights times
                 X) while our own weights stay honest: a lying peer, for tests. inner_step: the
                 step's gradients are NaN. weights: after the step, theta is multiplied by X
                 (NaN without =X): a replica whose weights went bad
  @N             only the Nth time the point is reached (1-based); %P: each time with probability P.
Without @N or %P the fault fires every time. Points off by default cost one dict lookup.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import re
import time
from dataclasses import dataclass

from noloco_node.errors import NodeError

log = logging.getLogger(__name__)

# donate_parameter: a state donor, before each parameter it sends (during_state_transfer: once,
# after the manifest, on both sides), so "donate_parameter:crash@3" dies after two parameters.
POINTS = (
    "before_forward",
    "mid_backward",
    "during_exchange",
    "exchange_write",
    "during_state_transfer",
    "donate_parameter",
    "send_snapshot",
    "inner_step",
    "weights",
)
POISON_POINTS = ("send_snapshot", "inner_step", "weights")
ACTIONS = ("crash", "stall", "delay", "error", "poison")
CRASH_EXIT_CODE = 17
_SPEC = re.compile(r"^(?P<point>[a-z_]+):(?P<action>[a-z]+)(=(?P<seconds>[0-9.]+))?(@(?P<nth>\d+)|%(?P<p>[0-9.]+))?$")


class FaultSpecError(ValueError):
    pass


class InjectedFault(NodeError):
    """An `error` fault: the operation at the point fails as if a peer had misbehaved."""


@dataclass(frozen=True)
class Fault:
    point: str
    action: str
    seconds: float = 0.0
    nth: int | None = None
    probability: float | None = None


def parse_fault(spec: str) -> Fault:
    match = _SPEC.match(spec.strip())
    if match is None:
        raise FaultSpecError(f"{spec!r} is not POINT:ACTION[=SECONDS][@N|%P]")
    point, action = match["point"], match["action"]
    if point not in POINTS:
        raise FaultSpecError(f"unknown point {point!r} in {spec!r} (points: {', '.join(POINTS)})")
    if action not in ACTIONS:
        raise FaultSpecError(f"unknown action {action!r} in {spec!r} (actions: {', '.join(ACTIONS)})")
    if (action == "poison") != (point in POISON_POINTS):
        raise FaultSpecError(f"{spec!r}: poison is the only action at {', '.join(POISON_POINTS)}, and only there")
    if action in ("stall", "delay") and match["seconds"] is None:
        raise FaultSpecError(f"{spec!r}: {action} needs =SECONDS")
    probability = float(match["p"]) if match["p"] is not None else None
    if probability is not None and not 0 < probability <= 1:
        raise FaultSpecError(f"{spec!r}: probability must be in (0, 1]")
    nth = int(match["nth"]) if match["nth"] is not None else None
    if nth is not None and nth < 1:
        raise FaultSpecError(f"{spec!r}: @N counts from 1")
    return Fault(point, action, float(match["seconds"] or 0.0), nth, probability)


class FaultInjector:
    """Holds the node's faults; `hit` (async code) and `hit_sync` (compute thread) fire them."""

    def __init__(self, specs: tuple[str, ...] | list[str] = (), seed: int | None = None) -> None:
        self.faults: dict[str, list[Fault]] = {}
        for spec in specs:
            fault = parse_fault(spec)
            self.faults.setdefault(fault.point, []).append(fault)
        self.hits: dict[str, int] = {}
        self.fired: list[tuple[str, str]] = []
        self.rng = random.Random(seed)

    def _due(self, point: str) -> list[Fault]:
        if point not in self.faults:
            return []
        count = self.hits[point] = self.hits.get(point, 0) + 1
        due = [
            f
            for f in self.faults[point]
            if (f.nth is None or f.nth == count) and (f.probability is None or self.rng.random() < f.probability)
        ]
        for fault in due:
            self.fired.append((point, fault.action))
            log.warning("injected fault: %s %s at hit %d", fault.action, point, count)
            if fault.action == "crash":
                logging.shutdown()
                os._exit(CRASH_EXIT_CODE)
        return due

    async def hit(self, point: str) -> None:
        for fault in self._due(point):
            if fault.action in ("stall", "delay"):
                await asyncio.sleep(fault.seconds)
            elif fault.action == "error":
                raise InjectedFault(f"injected error at {point}")

    def poison(self, point: str = "send_snapshot") -> float | None:
        """At a poison point: NaN or the scale to corrupt with, else None."""
        for fault in self._due(point):
            return fault.seconds if fault.seconds else math.nan
        return None

    def hit_sync(self, point: str) -> None:
        for fault in self._due(point):
            if fault.action in ("stall", "delay"):
                time.sleep(fault.seconds)
            elif fault.action == "error":
                raise InjectedFault(f"injected error at {point}")
