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
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from torch import Tensor

from noloco_node.pipeline.completions import Stage0Completions
from noloco_node.pipeline.ports import Hop, MicrobatchKey
from noloco_node.pipeline.worker import NonFiniteValues
from noloco_node.pipeline.runtime import StageRuntime, Ticket
from noloco_node.runtime.node_stats import DriverStats, MicrobatchCounts

log = logging.getLogger(__name__)


@dataclass
class DriverCounters:
    issued: int = 0
    completed: int = 0
    reissued: int = 0
    dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"issued": self.issued, "completed": self.completed, "reissued": self.reissued, "dropped": self.dropped}

    @classmethod
    def restored(cls, saved: dict | None) -> DriverCounters:
        """A restarted driver carries on its predecessor's accounting (from its checkpoint)."""
        return cls(**{name: int(value) for name, value in (saved or {}).items()})


@dataclass
class DriverLog:
    losses: list[float] = field(default_factory=list)  # per completed microbatch, in completion order
    step_times: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)  # mean over each inner step's completed microbatches
    # The worker's inner step that step_losses[-1] belongs to: the worker counts a step before
    # the driver logs its loss, so a reader between the two must not pair step k with k-1's loss.
    logged_step: int | None = None
    reissued_sequences: list[int] = field(default_factory=list)
    stale_microbatches: int = 0  # completed with an inner step between their forward and backward
    max_staleness: int = 0  # the most inner steps between one microbatch's forward and backward

    def record_step(self, lr: float, loss: float, inner_step: int) -> None:
        self.lrs.append(lr)
        self.step_losses.append(loss)
        self.step_times.append(time.monotonic())
        self.logged_step = inner_step

    def record_staleness(self, staleness: int) -> None:
        self.stale_microbatches += staleness > 0
        self.max_staleness = max(self.max_staleness, staleness)


@dataclass(frozen=True, kw_only=True)
class DriverSettings:
    microbatch_size: int
    microbatch_timeout_s: float
    """A microbatch whose gradient has not come back within this is re-issued."""
    max_attempts: int = 5
    sequential: bool = False
    """Deterministic mode: one microbatch at a time, in order (the oracle's order)."""
    overlap: bool = False
    """pipeline.schedule = overlap: batch k+1's forwards start before step k; their backwards wait
    at the gate of batch k+1, opened once step k is taken."""


HOP_CHECK_S = 1.0
"""How often a microbatch waiting for its gradient checks whether its next hop became unreachable."""
PROBE_AFTER_S = 5.0
"""A microbatch whose gradient is not back this long after it was sent asks its next hop's health
service whether it still answers (and again every as long): one check per hop, however many wait."""


class HopLost(Exception):
    """A microbatch's next hop failed a later call as unreachable: its gradient will not come."""


def overlapped(settings: DriverSettings, is_last: bool) -> bool:
    """Whether batches overlap: not in deterministic mode, and not with P = 1 (it accumulates at once)."""
    return settings.overlap and not settings.sequential and not is_last


class Stage0Driver:
    def __init__(
        self,
        runtime: StageRuntime,
        batches: Iterator[tuple[Tensor, Tensor]],
        settings: DriverSettings,
        *,
        completions: Stage0Completions,
        inner_step: Callable[[], Awaitable[float]] | None = None,
        counters: DriverCounters | None = None,
        before_batch: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`completions` is the one the runtime reports to; `inner_step` replaces the worker's own
        step (a method that takes it, dp); `counters` carries on a predecessor's accounting;
        `before_batch` is awaited before each batch is issued (the node waits there while a later
        stage has no replica, rather than issue microbatches nobody can take)."""
        self.runtime, self.batches, self.completions = runtime, batches, completions
        self.microbatch_size = settings.microbatch_size
        self.timeout_s, self.max_attempts = settings.microbatch_timeout_s, settings.max_attempts
        self.sequential = settings.sequential
        self.inner_step, self.before_batch = inner_step, before_batch
        self.counters = counters or DriverCounters()
        self.log = DriverLog()
        self._sequence = 0
        self._dropped_at_stop = 0
        self.stop_requested = False  # set by request_stop: run returns at the next step boundary
        self.overlap = overlapped(settings, runtime.shape.is_last)
        assert completions.gated == self.overlap, "the completions must gate exactly when the driver overlaps"
        if self.overlap:
            # A step can fall between a kept graph's forward and its backward: the graph must be
            # built on a weight copy (the node turns stash_weights on for the overlap schedule).
            assert runtime.worker.stash_weights, "overlap needs worker.stash_weights"

    def request_stop(self) -> None:
        """Finish the inner step under way (its microbatches complete and it steps), then return
        from run(): the driver's part of a graceful move to another stage."""
        self.stop_requested = True

    def stats_view(self) -> DriverStats:
        """Its microbatches, losses and schedule, as the node's stats report them."""
        log_ = self.log
        return DriverStats(
            microbatches=MicrobatchCounts(**self.counters.as_dict()),
            losses=list(log_.losses),
            lrs=list(log_.lrs),
            step_times=list(log_.step_times),
            step_losses=list(log_.step_losses),
            logged_step=log_.logged_step,
            reissued_sequences=list(log_.reissued_sequences),
            overlap=self.overlap,
            stale_microbatches=log_.stale_microbatches,
            max_staleness=log_.max_staleness,
        )

    async def run(self, steps: int, on_inner_step: Callable[[int], Awaitable[None]] | None = None) -> None:
        """Train `steps` inner steps (fewer if asked to stop); cancelled (a stop), the microbatches in
        flight are dropped and counted as dropped, with one line for all of them."""
        try:
            await self._run(steps, on_inner_step)
        except asyncio.CancelledError:
            if self._dropped_at_stop:
                log.info(
                    "training stopped with %d microbatch%s in flight: dropped (the summary counts them)",
                    self._dropped_at_stop,
                    "" if self._dropped_at_stop == 1 else "es",
                )
            raise

    async def _run(self, steps: int, on_inner_step: Callable[[int], Awaitable[None]] | None) -> None:
        previous: tuple[list[asyncio.Task], int, int] | None = None  # overlap: the batch still draining
        for batch in range(steps):
            if self.stop_requested:
                break
            if self.before_batch is not None:
                await self.before_batch()
            inputs, labels = next(self.batches)
            micro = [
                (inputs[i : i + self.microbatch_size], labels[i : i + self.microbatch_size])
                for i in range(0, inputs.shape[0], self.microbatch_size)
            ]
            if batch == 0:
                self.completions.open_gate(0)
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

    async def _finish_batch(
        self, tasks: list[asyncio.Task], batch: int, first: int, on_inner_step: Callable[[int], Awaitable[None]] | None
    ) -> None:
        """Wait for the batch's microbatches, take the inner step, open the next batch's gate."""
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if self.inner_step is not None:
            lr = await self.inner_step()
        else:
            lr = await self.runtime.compute.run(self.runtime.worker.step)
        done = self.log.losses[first:]
        self.log.record_step(lr, sum(done) / len(done) if done else float("nan"), self.runtime.worker.inner_steps)
        self.completions.open_gate(batch + 1)
        if on_inner_step is not None:
            # Hook for the outer step (the sync layer): called after every inner step.
            await on_inner_step(self.runtime.worker.inner_steps)

    async def _complete(self, inputs: Tensor, labels: Tensor, batch: int = 0) -> None:
        sequence = self._sequence
        self._sequence += 1
        self.completions.assign(sequence, batch)
        try:
            await self._attempts(sequence, inputs, labels)
        finally:
            self.completions.unassign(sequence)

    async def _gradient(self, future: asyncio.Future, sent: str) -> float:
        """The microbatch's loss once its gradient is back: TimeoutError past timeout_s, HopLost as
        soon as a later call to `sent` (its next hop) failed as unreachable. A killed next-stage
        replica held its microbatches for the whole timeout before (60 s a newcomer saw: the
        node trained nothing, fell behind its stage and had to copy its state again)."""
        since = time.monotonic()
        end, probe_at = since + self.timeout_s, since + PROBE_AFTER_S
        while (left := end - time.monotonic()) > 0:
            try:
                return await asyncio.wait_for(asyncio.shield(future), timeout=min(left, HOP_CHECK_S))
            except asyncio.TimeoutError:
                if self.runtime.unreachable_at.get(sent, -math.inf) > since:
                    raise HopLost(f"its next hop {sent[-8:]} stopped answering") from None
                # Nothing else may call a hop that stopped with our microbatches in it (a whole
                # batch there): ask it. A soak's SIGSTOPped replica stopped stage 0 for its freeze.
                if time.monotonic() >= probe_at:
                    probe_at = time.monotonic() + PROBE_AFTER_S
                    if not await self.runtime.hop_answers(sent):
                        raise HopLost(f"its next hop {sent[-8:]} does not answer a health check") from None
        raise asyncio.TimeoutError

    async def _whole(self, sequence: int, inputs: Tensor, labels: Tensor) -> None:
        try:
            loss, _ = await self.runtime.compute.run(self.runtime.worker.forward_backward_whole, inputs, labels)
        except NonFiniteValues as exc:
            self.counters.dropped += 1
            log.warning("microbatch %d dropped: %s", sequence, exc)
            return
        self.counters.completed += 1
        self.log.losses.append(loss)

    async def _attempts(self, sequence: int, inputs: Tensor, labels: Tensor) -> None:
        self.counters.issued += 1
        if self.runtime.shape.is_last:  # P = 1: nothing to route, the whole model is here
            return await self._whole(sequence, inputs, labels)
        me = self.runtime.me
        lost_on: set[str] = set()  # first hops that lost an attempt: re-issues prefer others
        for attempt in range(self.max_attempts):
            if attempt:
                self.counters.reissued += 1
                self.log.reissued_sequences.append(sequence)
            key = MicrobatchKey(me.peer_id, sequence, attempt)
            future, sent = self.completions.expect(key), None
            try:
                # Stage 0 keeps the graph instead of recomputing: in exact mode it steps only
                # between batches; in overlap mode the graph is built on stashed weights.
                steps_at_forward = self.runtime.worker.inner_steps
                output = await self.runtime.compute.run(self.runtime.worker.forward, key, inputs, keep_graph=True)
                route = [Hop(me.peer_id, me.address, 0)]
                self.runtime.in_flight[key] = Ticket(key=key, route=route)  # admits the gradient's Backward
                sent = await self.runtime.send_forward(key, route, output, labels, inputs, avoid=frozenset(lost_on))
                if sent is not None:
                    lost_on.add(sent)
                    loss = await self._gradient(future, sent)
                    self.runtime.router.returned(sent)
                    staleness = self.runtime.worker.inner_steps - steps_at_forward
                    self.log.record_staleness(staleness)
                    self.counters.completed += 1
                    self.log.losses.append(loss)
                    return
                # The runtime said so once for the whole outage (pipeline/outage.py). While a later
                # stage has no replica at all, the re-issue waits for one instead of using up its
                # attempts on nobody: a stage whose last replica left drops nothing.
                log.debug("microbatch %d attempt %d found no stage-1 replica; re-issuing", sequence, attempt)
                if self.before_batch is not None:
                    await self.before_batch()
            except HopLost as lost:
                log.info("microbatch %d attempt %d: %s; re-issuing now", sequence, attempt, lost)
            except asyncio.TimeoutError:
                shunned_s = self.runtime.router.lost(sent, self.timeout_s) if sent is not None else 0.0
                log.info(
                    "microbatch %d attempt %d got no gradient within %.0f s; re-issuing%s",
                    sequence,
                    attempt,
                    self.timeout_s,
                    f" (its next hop {sent[-8:]} gets none of ours for {shunned_s:.0f} s)" if sent else "",
                )
            except asyncio.CancelledError:
                # Training was stopped (shutdown) with this microbatch in flight: it is dropped, so
                # issued == completed + dropped holds for a stopped run too. A stop is what the
                # user asked for: run() says so once, not a warning per microbatch.
                self.counters.dropped += 1
                self._dropped_at_stop += 1
                log.debug("microbatch %d dropped: training stopped while it was in flight", sequence)
                raise
            finally:
                self.completions.forget(key)
                self.runtime.in_flight.pop(key, None)
                await self.runtime.compute.run(self.runtime.worker.drop, key)
        self.counters.dropped += 1
        log.warning("microbatch %d dropped after %d attempts", sequence, self.max_attempts)
