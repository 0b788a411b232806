"""What happens after every inner step of a node, in one place: the event, the outer-sync
boundary (the method decides whether a round runs), a checkpoint every K steps and, for
experiments, a snapshot of theta every K steps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from noloco_node.node.checkpoint import Checkpointer
from noloco_node.pipeline.driver import Stage0Driver
from noloco_node.pipeline.worker import StageWorker
from noloco_node.runtime.compute import ComputeThread
from noloco_node.runtime.events import EventLog
from noloco_node.sync.ports import OuterSync

log = logging.getLogger(__name__)


class Snapshots:
    """Experiments: theta every `every` inner steps as stage{s}-{peer}-step{k}.safetensors, and at
    the end as ...-final.safetensors (experiments evaluate them)."""

    def __init__(self, directory: Path, every: int, *, compute: ComputeThread, stage, name: str) -> None:
        self.directory, self.every, self.compute, self.stage, self.name = directory, every, compute, stage, name

    def due(self, inner_step: int) -> bool:
        return inner_step % self.every == 0

    async def save(self, inner_step: int, *, final: bool = False) -> None:
        from safetensors.torch import save_file

        tensors = await self.compute.run(
            lambda: {n: p.detach().to("cpu", copy=True).contiguous() for n, p in self.stage.named_parameters()}
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{self.name}-{'final' if final else f'step{inner_step}'}.safetensors"
        await asyncio.to_thread(save_file, tensors, str(path))


class InnerStepBoundary:
    def __init__(
        self,
        *,
        worker: StageWorker,
        sync: OuterSync,
        events: EventLog,
        compute: ComputeThread,
        stage_index: int,
        bytes_sent: Callable[[], int],
        checkpoints: Checkpointer | None = None,
        snapshots: Snapshots | None = None,
    ) -> None:
        self.worker, self.sync, self.events, self.compute = worker, sync, events, compute
        self.stage_index, self.bytes_sent = stage_index, bytes_sent
        self.checkpoints, self.snapshots = checkpoints, snapshots
        # A later stage runs its boundaries in the background of the gradient that stepped it, so
        # several can be pending at once; they are taken one at a time, in step order (asyncio.Lock
        # wakes its waiters first come, first served).
        self._in_order = asyncio.Lock()
        self._queued: set[int] = set()  # steps whose boundary waits for an earlier one

    async def __call__(self, inner_step: int, driver: Stage0Driver | None = None) -> None:
        self._emit(inner_step, driver)
        self._queued.add(inner_step)
        try:
            async with self._in_order:
                self._queued.discard(inner_step)
                if (later := self._later_round(inner_step)) is not None:
                    # Run now, this round would snapshot weights that moved on past its own step and
                    # the one queued after it would follow with nothing trained between: a model
                    # audit saw a later stage fire rounds 30-33 within a second after a slow one.
                    log.info(
                        "outer round of inner step %d left out: the round of inner step %d is due already",
                        inner_step,
                        later,
                    )
                else:
                    await self.sync.at_boundary(inner_step)
                if self.checkpoints is not None and self.checkpoints.due(inner_step):
                    await self.checkpoint(driver)
                if self.snapshots is not None and self.snapshots.due(inner_step):
                    await self.snapshots.save(inner_step)
        finally:
            self._queued.discard(inner_step)

    def _later_round(self, inner_step: int) -> int | None:
        """The latest queued step whose round supersedes this step's, if this one may be left out."""
        if not self.sync.may_skip_round(inner_step):
            return None
        later = [s for s in self._queued if s > inner_step and self.sync.may_skip_round(s)]
        return max(later) if later else None

    async def checkpoint(self, driver: Stage0Driver | None) -> None:
        microbatches = driver.counters.as_dict() if driver is not None else None
        try:
            path = await self.checkpoints.save(self.stage_index, microbatches)
        except OSError as e:  # a full disk must not end the training: the last checkpoint stays
            log.warning(
                "could not write the checkpoint of inner step %d in %s (%s); training goes on, the "
                "previous checkpoint stays",
                self.worker.inner_steps,
                self.checkpoints.directory,
                e.strerror or e,
            )
            return
        # Under outer.overlap a round started at this very boundary is still under way: its update is
        # not in the checkpoint (a resume takes it up at the next round), and the line says so.
        under_way = self.sync.round_bound_s() > 0
        log.info(
            "checkpoint at inner step %d, outer round %d%s: %s (%.1f MB)",
            self.worker.inner_steps,
            self.checkpoints.last_saved.get("outer_round", 0),
            " (the round under way is not in it)" if under_way else "",
            path,
            path.stat().st_size / 1e6,
        )
        self.events.emit("checkpoint", inner_step=self.worker.inner_steps, file=str(path))

    def _emit(self, inner_step: int, driver: Stage0Driver | None) -> None:
        fields = {
            "inner_step": inner_step,
            "lr": self.worker.last_lr,
            "tokens": self.worker.tokens_total,
            "bytes_sent": self.bytes_sent(),
            "idle_s": round(self.compute.idle_s, 4),
            "busy_s": round(self.compute.busy_s, 4),
        }
        if driver is not None and driver.log.step_losses:
            fields["loss"] = driver.log.step_losses[-1]
            fields["lr"] = driver.log.lrs[-1]
        self.events.emit("inner_step", **fields)
