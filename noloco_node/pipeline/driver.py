"""Stage 0 drives training: it reads its data shard, issues microbatches into the pipeline,
waits for their gradients, re-issues any that are lost, and takes the inner step per batch.

Counters: `issued` counts distinct microbatches; each one ends `completed` or `dropped` (after
`max_attempts`, or in flight when training stops; reported, never silent), so
issued == completed + dropped at the end.
`reissued` counts extra attempts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from torch import Tensor

from noloco_node.pipeline.ports import Hop, MicrobatchKey
from noloco_node.pipeline.worker import NonFiniteValues
from noloco_node.pipeline.runtime import StageRuntime, Ticket

log = logging.getLogger(__name__)


@dataclass
class DriverCounters:
    issued: int = 0
    completed: int = 0
    reissued: int = 0
    dropped: int = 0


@dataclass
class DriverLog:
    losses: list[float] = field(default_factory=list)  # per completed microbatch, in completion order
    step_times: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)  # mean over each inner step's completed microbatches
    reissued_sequences: list[int] = field(default_factory=list)
    stale_microbatches: int = 0  # completed with an inner step between their forward and backward
    max_staleness: int = 0  # the most inner steps between one microbatch's forward and backward


class Stage0Driver:
    def __init__(self, runtime: StageRuntime, batches: Iterator[tuple[Tensor, Tensor]], *, microbatch_size: int,
                 microbatch_timeout_s: float, max_attempts: int = 5, sequential: bool = False,
                 step_fn: Callable[[], Awaitable[float]] | None = None, overlap: bool = False) -> None:
        self.runtime, self.batches = runtime, batches
        self.microbatch_size = microbatch_size
        self.timeout_s, self.max_attempts, self.sequential = microbatch_timeout_s, max_attempts, sequential
        self.step_fn = step_fn  # replaces the local inner step (the dp baseline all-reduces first)
        self.counters = DriverCounters()
        self.log = DriverLog()
        self._pending: dict[MicrobatchKey, asyncio.Future] = {}
        self._sequence = 0
        self.stop_requested = False  # set by request_stop: run returns at the next step boundary
        # pipeline.schedule = overlap: batch k+1's forwards start before step k; their backwards
        # wait at the gate of batch k+1, opened once step k is taken.
        self.overlap = overlap and not sequential and not runtime.shape.is_last  # P = 1 accumulates at once
        self._batch_of: dict[int, int] = {}  # sequence -> batch index within this run
        self._gates: dict[int, asyncio.Event] = {}
        runtime.on_stage0_backward = self._on_backward
        if self.overlap:
            runtime.before_stage0_backward = self._wait_for_gate
            # A step can fall between a kept graph's forward and its backward: the graph must be
            # built on a weight copy (the node turns stash_weights on for the overlap schedule).
            assert runtime.worker.stash_weights, "overlap needs worker.stash_weights"

    def request_stop(self) -> None:
        """Finish the inner step under way (its microbatches complete and it steps), then return
        from run(): the driver's part of a graceful move to another stage."""
        self.stop_requested = True

    def _on_backward(self, key: MicrobatchKey, loss: float) -> None:
        future = self._pending.get(key)
        if future is not None and not future.done():
            future.set_result(loss)

    async def run(self, steps: int, on_inner_step: Callable[[int], Awaitable[None]] | None = None) -> None:
        previous: tuple[list[asyncio.Task], int, int] | None = None  # overlap: the batch still draining
        for batch in range(steps):
            if self.stop_requested:
                break
            inputs, labels = next(self.batches)
            micro = [(inputs[i:i + self.microbatch_size], labels[i:i + self.microbatch_size])
                     for i in range(0, inputs.shape[0], self.microbatch_size)]
            if batch == 0:
                self._gates.setdefault(0, asyncio.Event()).set()
            if not self.overlap:
                first = len(self.log.losses)
                if self.sequential:
                    for mb in micro:
                        await self._complete(*mb, batch=batch)
                else:
                    await asyncio.gather(*(self._complete(*mb, batch=batch) for mb in micro))
                await self._finish_batch([], batch, first, on_inner_step)
            else:
                tasks = [asyncio.create_task(self._complete(*mb, batch=batch)) for mb in micro]
                try:
                    if previous is not None:
                        await self._finish_batch(*previous, on_inner_step)
                except BaseException:
                    for task in tasks:  # stopped or failed: the next batch's microbatches end dropped
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise
                previous = (tasks, batch, len(self.log.losses))
        if previous is not None:
            await self._finish_batch(*previous, on_inner_step)

    async def _finish_batch(self, tasks: list[asyncio.Task], batch: int, first: int,
                            on_inner_step: Callable[[int], Awaitable[None]] | None) -> None:
        """Wait for the batch's microbatches, take the inner step, open the next batch's gate."""
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if self.step_fn is not None:
            lr = await self.step_fn()
        else:
            lr = await self.runtime.compute.run(self.runtime.worker.step)
        self.log.lrs.append(lr)
        done = self.log.losses[first:]
        self.log.step_losses.append(sum(done) / len(done) if done else float("nan"))
        self.log.step_times.append(time.monotonic())
        self._gates.pop(batch, None)
        self._gates.setdefault(batch + 1, asyncio.Event()).set()
        if on_inner_step is not None:
            # Hook for the outer step (the sync layer): called after every inner step.
            await on_inner_step(self.runtime.worker.inner_steps)

    async def _wait_for_gate(self, key: MicrobatchKey) -> None:
        """Overlap: a backward of batch k+1 arriving before step k waits for it, so the gradients
        of two batches never mix in one step."""
        batch = self._batch_of.get(key.sequence)
        if batch is not None:
            await self._gates.setdefault(batch, asyncio.Event()).wait()

    async def _complete(self, inputs: Tensor, labels: Tensor, batch: int = 0) -> None:
        sequence = self._sequence
        self._sequence += 1
        self._batch_of[sequence] = batch
        try:
            await self._attempts(sequence, inputs, labels)
        finally:
            self._batch_of.pop(sequence, None)

    async def _attempts(self, sequence: int, inputs: Tensor, labels: Tensor) -> None:
        self.counters.issued += 1
        if self.runtime.shape.is_last:  # P = 1: nothing to route, the whole model is here
            try:
                loss, _ = await self.runtime.compute.run(self.runtime.worker.forward_backward_whole, inputs, labels)
            except NonFiniteValues as exc:
                self.counters.dropped += 1
                log.warning("microbatch %d dropped: %s", sequence, exc)
                return
            self.counters.completed += 1
            self.log.losses.append(loss)
            return
        me = self.runtime.me
        lost_on: set[str] = set()  # first hops that lost an attempt: re-issues prefer others
        for attempt in range(self.max_attempts):
            if attempt:
                self.counters.reissued += 1
                self.log.reissued_sequences.append(sequence)
            key = MicrobatchKey(me.peer_id, sequence, attempt)
            future = asyncio.get_running_loop().create_future()
            self._pending[key] = future
            try:
                # Stage 0 keeps the graph instead of recomputing: in exact mode it steps only
                # between batches; in overlap mode the graph is built on stashed weights.
                steps_at_forward = self.runtime.worker.inner_steps
                output = await self.runtime.compute.run(self.runtime.worker.forward, key, inputs, keep_graph=True)
                route = [Hop(me.peer_id, me.address, 0)]
                self.runtime.in_flight[key] = Ticket(key=key, route=route)  # admits the gradient's Backward
                sent = await self.runtime.send_forward(key, route, output, labels, avoid=frozenset(lost_on))
                if sent is not None:
                    lost_on.add(sent)
                    loss = await asyncio.wait_for(asyncio.shield(future), timeout=self.timeout_s)
                    staleness = self.runtime.worker.inner_steps - steps_at_forward
                    self.log.stale_microbatches += staleness > 0
                    self.log.max_staleness = max(self.log.max_staleness, staleness)
                    self.counters.completed += 1
                    self.log.losses.append(loss)
                    return
                log.info("microbatch %d attempt %d found no stage-1 replica; re-issuing", sequence, attempt)
            except asyncio.TimeoutError:
                log.info("microbatch %d attempt %d got no gradient within %.0f s; re-issuing", sequence, attempt, self.timeout_s)
            except asyncio.CancelledError:
                # Training was stopped (shutdown) with this microbatch in flight: it is dropped,
                # and said so, so issued == completed + dropped holds for a stopped run too.
                self.counters.dropped += 1
                log.warning("microbatch %d dropped: training stopped while it was in flight", sequence)
                raise
            finally:
                self._pending.pop(key, None)
                self.runtime.in_flight.pop(key, None)
                await self.runtime.compute.run(self.runtime.worker.drop, key)
        self.counters.dropped += 1
        log.warning("microbatch %d dropped after %d attempts", sequence, self.max_attempts)
