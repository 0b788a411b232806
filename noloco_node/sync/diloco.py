"""DiLoCo baseline outer step: the mean of the fast weights over *all* replicas of the stage
through a real all-reduce (hivemind's averager), then the shared heavy-ball update on phi."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from torch import Tensor

from noloco_node.optim.state import OuterState
from noloco_node.runtime.compute import ComputeThread
from noloco_node.sync.noloco import OuterCounters

log = logging.getLogger(__name__)


class AllReduce(Protocol):
    async def mean(self, tensors: list[Tensor], timeout_s: float,
                   round_index: int) -> tuple[list[Tensor], int, bool, bool]:
        """Group mean, group size (1 = nobody joined), whether all members were at this round, and
        whether the whole mean arrived (else some parts are our own values)."""


class DiLoCoSync:
    def __init__(self, state: OuterState, *, all_reduce: AllReduce, compute: ComputeThread, timeout_s: float) -> None:
        self.state, self.all_reduce, self.compute, self.timeout_s = state, all_reduce, compute, timeout_s
        self.counters = OuterCounters()

    async def outer_step(self, inner_step: int, round_index: int) -> str:
        start = time.monotonic()
        names = list(self.state.params)
        snapshot = await self.compute.run(self.state.snapshot)
        thetas = [snapshot[n][1] for n in names]
        means, group, same_round, complete = await self.all_reduce.mean(thetas, self.timeout_s, round_index)
        await self.compute.run(self.state.apply_diloco, dict(zip(names, means)))
        outcome = "paired" if group > 1 else "solo"
        setattr(self.counters, outcome, getattr(self.counters, outcome) + 1)
        self.counters.rounds += 1
        if not same_round:
            self.counters.mixed_rounds += 1
            log.warning("round %d: the all-reduce group mixed replicas of different rounds", round_index)
        self.counters.partial_rounds += not complete
        self.counters.history.append({"round": round_index, "outcome": outcome, "group": group,
                                      "same_round": same_round, "complete": complete,
                                      "seconds": time.monotonic() - start})
        log.info("round %d: all-reduce over %d replicas", round_index, group)
        return outcome
