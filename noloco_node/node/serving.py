"""Serving a stage until done: stage 0 trains (until the run's `inner.total_steps`, or inner step N
with `--steps N`), waiting first for a replica of every later stage however long that takes; every
node serves until stopped, and a node the rebalancing plan names moves to another stage and carries on
there; a node left rounds behind its stage's replicas copies their state the same way
(node/catching_up.py). What `join` runs once its arguments are read (cli/join.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from noloco_node.node.catching_up import RECOPY, Recopy
from noloco_node.node.lifecycle import Membership, Node

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServePlan:
    steps: int | None = None
    """Stage 0: train until inner step N, then leave; None = until the run's inner.total_steps,
    then keep serving (the trained state, for joiners and `export`) until stopped; 0 = train
    nothing, only serve (a state donor, tests)."""
    serve_after: bool = False
    """Stage 0 with steps: keep serving after the last step, until stopped."""

    def last_step(self, total_steps: int) -> int:
        return total_steps if self.steps is None else self.steps

    @property
    def serves_after(self) -> bool:
        return self.serve_after or self.steps is None

    @property
    def trains(self) -> bool:
        return self.steps != 0

    wait_replicas: int = 1
    """Stage 0: wait until every stage has this many replicas before training."""


class StageReporter:
    """What a served stage tells the outside: called after every inner step and every 0.1 s, and
    told when the node changes (a move) and when it stops."""

    async def attach(self, node: Node) -> None: ...

    async def __call__(self, inner_step: int = 0) -> None: ...

    def stopping(self, node: Node) -> None: ...

    def stopped(self, node: Node) -> None: ...


async def serve(node: Node, plan: ServePlan, stop: asyncio.Event, reporter: StageReporter) -> int:
    """Serve `node` (moving it as the plan asks) until stopped or done; stops it; returns 0."""
    while True:
        await reporter.attach(node)
        periodic = asyncio.create_task(_every(0.1, reporter))
        moving = False
        try:
            moving = await _serve_stage(node, plan, stop, reporter)
        finally:
            periodic.cancel()
            if not moving:
                reporter.stopping(node)
                try:
                    await node.stop()
                finally:  # after stop: bytes, drained and dropped microbatches are final
                    reporter.stopped(node)
        if not moving:
            return 0
        node = await moved(node)


async def _every(period_s: float, report: Callable[[], Awaitable[None]]) -> None:
    # Always polled: stages > 0 have no per-step callback, and their step lines come from it.
    while True:
        await asyncio.sleep(period_s)
        await report()


async def _serve_stage(node: Node, plan: ServePlan, stop: asyncio.Event, report) -> bool:
    """Serve (and on stage 0 with steps, train) until stopped, done, or a rebalancing move is
    planned for this node; True = move."""
    last = plan.last_step(node.config.inner.total_steps)
    if node.stage_index == 0 and not plan.trains:
        pass  # serve only
    elif node.stage_index == 0 and node.worker.inner_steps < last:
        await race(node.wait_for_replicas(plan.wait_replicas), stop)
        if stop.is_set():
            return False
        # Until inner step N: a resumed node or one that fetched a replica's state starts past 0.
        if await _train_unless_moved(node, last - node.worker.inner_steps, stop, report):
            return True
        if not stop.is_set():
            node.done_at_step = node.worker.inner_steps  # all its steps trained, whether it serves on or exits
        if not plan.serves_after or stop.is_set():
            return False
        _done(node)
        await report()
    elif node.stage_index == 0:
        if not plan.serves_after:
            return False  # a node that moved onto stage 0 past inner step N has nothing left to train
        _done(node)
    await first_of(stop.wait(), node.move_requested.wait())
    return node.move_requested.is_set() and not stop.is_set()


def _done(node: Node) -> None:
    node.done_at_step = node.worker.inner_steps
    log.info(
        "trained all %d inner steps; serving the trained state (for joiners and `noloco-node export`) until stopped",
        node.done_at_step,
    )


async def _train_unless_moved(node: Node, steps: int, stop: asyncio.Event, report) -> bool:
    """Train `steps` inner steps; stop cancels it, a planned move lets the step under way finish
    (no microbatch lost) and returns True."""
    training = asyncio.ensure_future(node.train(steps, on_inner_step=report))
    await first_of(training, stop.wait(), node.move_requested.wait())
    if training.done():
        training.result()
        return False
    if stop.is_set() or node.driver is None:
        training.cancel()
        try:
            await training
        except asyncio.CancelledError:
            pass
        return False
    node.driver.request_stop()
    await training
    return True


async def first_of(*aws) -> None:
    """Wait until the first of `aws` finishes; cancel the rest (a task passed in is left running)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task, original in zip(tasks, aws):
        if task in pending and task is not original:
            task.cancel()


async def race(coro, stop: asyncio.Event) -> None:
    """Run `coro` until it finishes or `stop` is set (then cancel it)."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task not in done:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return
    task.result()


async def moved(node: Node) -> Node:
    """Leave this stage gracefully (withdraw, drain, no checkpoint of it) and come back on
    the planned stage under the same identity; Node.create fetches the new stage's state from a
    replica. A Recopy (node/catching_up.py) comes back on the same stage, having checkpointed its
    own state first, in case no replica can give one."""
    move = node.move
    recopy = isinstance(move, Recopy)
    log.info("moving: %s", move)
    await node.stop(final=False, same_stage=recopy)
    record = {"from": move.source, "to": move.target, "at": time.time(), "inner_step": node.worker.inner_steps}
    if recopy:
        record["why"] = RECOPY
    if node.driver is not None:
        record["microbatches"] = node.driver.counters.as_dict()
    cfg = node.config
    # The stage named (a node that chose its own, `--stage auto`, would choose again), and movable
    # as before: only a movable node is moved by the plan, and a Recopy stays what it was.
    there = dataclasses.replace(
        cfg, pipeline=dataclasses.replace(cfg.pipeline, stage=move.target, rebalance=node.movable)
    )
    new = await Node.create(there, outputs=node.outputs, membership=Membership(node.identity, node.moves + [record]))
    new.events.emit("moved", **record)
    fetched = new.fetched_state
    how = (
        f"its state copied from {fetched['donor'][-8:]} at inner step {fetched['inner_step']}"
        if fetched
        else "resumed from its own state (no copy)"
    )
    log.info("moved to stage %d: %s", new.stage_index, how)
    return new
