"""DiLoCo baseline outer step: the mean of the fast weights over *all* replicas of the stage
through a real all-reduce (hivemind's averager), then the shared heavy-ball update on phi."""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from noloco_node.config import OuterConfig
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.worker import StageWorker
from noloco_node.sync.ports import AllReduce, MethodTraits, OuterSync, SyncParts

log = logging.getLogger(__name__)


def all_reduce_shapes(worker: StageWorker) -> list[torch.Size]:
    """The tensors one DiLoCo round averages: the stage's fast weights theta."""
    return [p.shape for p in worker.stage.parameters()]


class DiLoCoSync(OuterSync):
    # The all-reduce baselines route balanced: every replica must get one batch per step so all
    # of a stage's replicas reach each round together.
    traits = MethodTraits(
        "diloco", syncs=True, outer_rounds=True, balanced_routing=True, all_reduce_shapes=all_reduce_shapes
    )

    def __init__(
        self, state: OuterState, config: OuterConfig, parts: SyncParts, *, all_reduce: AllReduce, timeout_s: float
    ) -> None:
        super().__init__()
        self.state, self.parts, self.all_reduce, self.timeout_s = state, parts, all_reduce, timeout_s
        self.compute = parts.compute
        self.every = config.inner_steps_per_outer
        self._one_round_at_a_time = asyncio.Lock()

    async def at_boundary(self, inner_step: int) -> None:
        if inner_step % self.every:
            return
        async with self._one_round_at_a_time:
            await self._track(asyncio.ensure_future(self.outer_step(inner_step, inner_step // self.every)))
        self.parts.emit("outer_round", inner_step=inner_step, **self.counters.history[-1])

    @property
    def outer_round(self) -> int:
        return self.state.round

    @property
    def bytes_sent(self) -> int:
        return self.all_reduce.bytes_sent

    @property
    def bytes_received(self) -> int:
        """An all-reduce member receives what it sends (each sends its part of the others' chunks
        and gets theirs of its own)."""
        return self.all_reduce.bytes_sent

    async def close(self) -> None:
        await asyncio.to_thread(self.all_reduce.shutdown)

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
        self.counters.history.append(
            {
                "round": round_index,
                "outcome": outcome,
                "group": group,
                "same_round": same_round,
                "complete": complete,
                "seconds": time.monotonic() - start,
            }
        )
        log.info("round %d: all-reduce over %d replicas", round_index, group)
        return outcome
