"""Data-parallel baseline ("FSDP" in the reference, nothing sharded): every inner step, this
stage's clipped gradients are averaged over its replicas by the all-reduce, then Adam steps.

Clipping is per stage and before the all-reduce, as the reference (`train.py:175`). Stage 0's
driver calls the step at its batch boundary; stages > 0 call it when a batch worth of sequences
has been accumulated, before the batch's last gradient goes upstream (pipeline/runtime.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from noloco_node.pipeline.worker import StageWorker
from noloco_node.runtime.compute import ComputeThread
from noloco_node.sync.diloco import AllReduce
from noloco_node.sync.noloco import OuterCounters


class DataParallelStep:
    def __init__(self, *, worker: StageWorker, compute: ComputeThread, all_reduce: AllReduce, timeout_s: float,
                 after_step: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.worker, self.compute, self.all_reduce, self.timeout_s = worker, compute, all_reduce, timeout_s
        self.after_step = after_step  # stages > 0: the node's inner-step hook (events, checkpoints, snapshots)
        self.counters = OuterCounters()

    async def __call__(self) -> float:
        """One inner step: all-reduce this batch's clipped gradients, step Adam; returns the lr."""
        start = time.monotonic()
        step = self.worker.inner_steps + 1
        grads = await self.compute.run(self.worker.take_gradients)
        means, group, same, complete = await self.all_reduce.mean(grads, self.timeout_s, step)
        lr = await self.compute.run(self.worker.step_with, means)
        c = self.counters
        c.rounds += 1
        c.paired += group > 1
        c.solo += group == 1
        c.mixed_rounds += not same
        c.partial_rounds += not complete
        c.history.append({"round": step, "outcome": "paired" if group > 1 else "solo", "group": group,
                          "same_round": same, "complete": complete, "seconds": time.monotonic() - start})
        if self.after_step is not None:
            await self.after_step(self.worker.inner_steps)
        return lr
