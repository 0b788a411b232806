"""The swarm's view of a node, kept current: the heartbeat (our record, our reach, our neighbours)
and the rebalancing watch that may ask the node to move (pipeline/rebalance.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from noloco_node.node.adapters import swarm_replicas
from noloco_node.node.joining import public_libp2p_addrs
from noloco_node.node.waiting import look_around
from noloco_node.pipeline.rebalance import watch
from noloco_node.runtime.every import LOOK_BUSY_S, LOOK_IDLE_S, TOUCH_PERIOD_S, Every

if TYPE_CHECKING:
    from noloco_node.node.lifecycle import Node

log = logging.getLogger(__name__)

MAX_ANNOUNCING = 2
"""Stores of our record in flight at once (each renews it at the peers that answer)."""


async def heartbeat(node: Node) -> None:
    """Every timeouts.heartbeat_s until cancelled, on time: measure, keep in touch with the DHT,
    announce our record, look around, expire saved inputs, re-probe our reach, and (behind NAT)
    dial out. The DHT's calls run in tasks of their own, so one that waits on a hung peer holds up
    neither the next period nor our record: in a soak, a SIGSTOPped peer made healthy replicas'
    records 4-7 s old against an 8 s lifetime (the lookup and the store took turns with the sleep)."""
    touch, look = Every(), Every()
    touching = looking = None
    announcing: set[asyncio.Task] = set()
    period = node.config.timeouts.heartbeat_s
    loop = asyncio.get_running_loop()
    next_at = loop.time() + period
    while True:
        await asyncio.sleep(max(0.0, next_at - loop.time()))
        next_at = max(next_at + period, loop.time() + period / 10)
        try:
            node.meter.sample(
                sequences=node.worker.sequences_total,
                busy_s=node.parts.compute.busy_s,
                in_flight=len(node.runtime.in_flight),
                window=node.config.pipeline.max_in_flight,
            )
            if (touching is None or touching.done()) and touch.due(TOUCH_PERIOD_S):
                touching = node.spawn(node.directory.keep_in_touch())
            # A store reaches the healthy peers at once and returns when the slowest answered or
            # timed out: a second one may start meanwhile, not more.
            announcing = {task for task in announcing if not task.done()}
            if len(announcing) < MAX_ANNOUNCING:
                announcing.add(node.spawn(_logged(node, node.announce(), "announcing our record")))
            if looking is None or looking.done():
                looking = node.spawn(_logged(node, _look_around(node, look), "looking around"))
            await node.runtime.expire_saved()
            if node.reprobe is not None and node.reprobe.due():  # its own task: a probe takes seconds
                node.spawn(node.reprobe.run())
            # Behind NAT (see joining.py); not while the daemon restarts: the bridge's is gone.
            if node.links.reach != "direct" and node.links.bridge is not None and not node.directory.restarting:
                await node.links.bridge.dial_out(
                    await public_libp2p_addrs(node.directory, node.config.pipeline.num_stages)
                )
        except Exception as exc:  # noqa: BLE001 - a failed heartbeat is retried next period
            _failed(node, exc, "heartbeat")


async def _logged(node: Node, work, what: str) -> None:
    try:
        await work
    except Exception as exc:  # noqa: BLE001 - retried next period
        _failed(node, exc, what)


def _failed(node: Node, exc: Exception, what: str) -> None:
    if node.stopping:  # a Ctrl-C or systemd's stop reaches our libp2p daemon too: expected
        log.info("%s while stopping: %r", what, exc)
    else:
        log.error("%s failed", what, exc_info=exc)


async def _look_around(node: Node, look: Every) -> None:
    """How many replicas our stage has (a lone one pairs with nobody), and, unless we already wait
    for something else, which neighbouring stage has none (we wait for it, and say so). Every
    LOOK_IDLE_S while we make no progress, every LOOK_BUSY_S while we do: a training node has its
    neighbours, and DHT lookups on every 1 s heartbeat cost a busy machine ~15% of its
    throughput (and an idle swarm of three processes 60% more CPU)."""
    busy = node.progress.since_progress_s() < 2 * node.config.timeouts.heartbeat_s
    # A view of our stage as lone is looked at again soon: it may be from before a fellow
    # replica announced itself, and it turns every solo round into a "no second replica" warning.
    lone = (node.stage_replicas or 0) < 2
    if not look.due(LOOK_BUSY_S if busy and not lone else LOOK_IDLE_S):
        return
    node.stage_replicas, missing = await look_around(node.directory, node.stage_index, node.config.pipeline.num_stages)
    if node.progress.waiting_for is None or node.progress.waiting_for.startswith("a stage-"):
        node.progress.wait(missing)
    if not busy and node.stage_index > 0 and node.run_finished_at is None:
        await _notice_a_finished_run(node)


async def _notice_a_finished_run(node: Node) -> None:
    """A later stage idle because stage 0's replicas trained all of inner.total_steps is done, not
    stalled: it says so once, and warns no more (a newcomer read "no inner step for 8 min ... see
    doctor" on every stage-1 node, `status` and both pages of a finished run)."""
    total = node.config.inner.total_steps
    first = await node.directory.replicas(0)
    if first and all(r.inner_step >= total for r in first):
        node.run_finished_at = total
        log.info(
            "the run is finished: stage 0's replicas trained all %d inner steps (inner.total_steps); this node "
            "only serves now (its state, for joiners and `noloco-node export`): stop it when you like",
            total,
        )


async def watch_balance(node: Node) -> None:
    """Rebalancing (pipeline/rebalance.py): when the plan names this node, ask whoever serves it
    to move it (node/serving.py: it drains, leaves and comes back on the target stage)."""
    p = node.config.pipeline
    node.move = await watch(
        me=node.peer_id,
        read=lambda: swarm_replicas(node.directory),
        claim=node.claim_move,
        num_stages=p.num_stages,
        margin=p.rebalance_margin,
        period_s=p.rebalance_period_s,
        settle_s=2 * p.rebalance_period_s,
        cooldown_s=10 * p.rebalance_period_s,
    )
    node.events.emit(
        "move_planned",
        source=node.move.source,
        target=node.move.target,
        throughput_now=node.move.throughput_now,
        throughput_after=node.move.throughput_after,
    )
    node.move_requested.set()
