"""Rebalancing a running swarm: when one stage limits the swarm, one node moves there.

The swarm sustains what its weakest stage sustains: the minimum over stages of the sum of their
replicas' measured capacities (runtime/throughput.py). Every `pipeline.rebalance_period_s` each
movable node reads every stage's records from the DHT and runs `plan_move` on them. The plan is a
pure function of that view, so every node computes the same one and only the node it names moves:

- no plan while the swarm is not settled: a joiner's claim, a node leaving or a node's claim to
  move is in the DHT, a node moved less than `settle_s` ago (its new stage is not measured yet),
  or a whole stage is unmeasured; so one node moves at a time. A single replica not measured yet counts as its
  stage's mean;
- the target is the limiting stage, and only when it is saturated: its replicas together do at
  least `SATURATED` of what they can (throughput / capacity). A stage with spare capacity is not
  what holds the swarm back, however small its total: the drivers' issue rate or the links are,
  and taking a node from elsewhere (a stage-0 node is also a driver) would only lose its share;
- a candidate is a movable node on another stage that keeps at
  least one replica there, its capacity on the target estimated from its own capacity scaled by the
  two stages' mean capacities (stages cost different compute per sequence);
- the move that leaves the swarm the highest minimum wins (ties: the lowest peer id), and only if
  the swarm today sustains less than `margin` of what it would after the move (Petals moves below
  0.75 of optimal). That margin is the hysteresis: a move back would lower the minimum, so it is
  never planned; and a node that moved is not a candidate again for `cooldown_s`.

Views of the DHT differ for a while, so two nodes can each find themselves named in the same
period (seen under load: two stage-0 replicas moved at once). A named node therefore claims the
move first (`move_claimed_at` in its record, which also unsettles everyone else's plan), waits at
least a period for claims to land, reads again and moves only if its claim is the earliest and its
own move, claims aside, still clears the margin; otherwise it withdraws the claim. Its own move,
not the best one: capacities are measured, and replicas of one stage measure within a few percent
of each other, so which of them is best flips from one read to the next; asking that the claimant
still be the best made claims fail over and over (seen: a move planned in the third period only).
Of two claimants A before B, B reads after A's claim was stored (A stores before it waits, B reads
a period after it claimed), sees the earlier claim and stays; A moves whether or not it saw B's.

Who is movable: a node that chose its stage with `--stage auto`, or any node with
`pipeline.rebalance = true`; `false` pins it. The move itself (drain, withdraw, fetch the new
stage's state from a replica, announce there) is the join command's (cli/join.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from noloco_node.runtime.node_status import Status

log = logging.getLogger(__name__)

SATURATED = 0.6
"""A stage whose replicas do less than this share of their measured capacity has room to spare."""


@dataclass(frozen=True)
class Replica:
    peer_id: str
    stage: int
    capacity: float
    throughput: float = 0.0
    status: str = Status.SERVING
    movable: bool = False
    moved_at: float = 0.0
    move_claimed_at: float = 0.0


@dataclass(frozen=True)
class Move:
    peer_id: str
    source: int
    target: int
    throughput_now: float
    throughput_after: float

    def __str__(self) -> str:
        return (
            f"peer {self.peer_id[-8:]} stage {self.source} -> {self.target}: swarm throughput "
            f"{self.throughput_now:.2f} -> {self.throughput_after:.2f} sequences/s (estimated)"
        )


def stage_totals(replicas: Sequence[Replica], num_stages: int) -> list[float]:
    totals = [0.0] * num_stages
    for r in replicas:
        totals[r.stage] += r.capacity
    return totals


def _measured(r: Replica, stage_members: Sequence[Replica]) -> Replica:
    if r.capacity > 0:
        return r
    known = [m.capacity for m in stage_members if m.capacity > 0]
    return dataclasses.replace(r, capacity=sum(known) / len(known))


def plan_move(
    replicas: Sequence[Replica],
    num_stages: int,
    *,
    margin: float,
    now: float,
    settle_s: float,
    cooldown_s: float,
    mover: str | None = None,
) -> Move | None:
    """The one move the swarm should make now, or None (module docstring). With `mover`, only
    that node is a candidate: its move, if it clears the margin."""
    if num_stages < 2 or not replicas:
        return None
    if any(
        r.status not in (Status.SERVING, Status.MATCHING) or now - r.moved_at < settle_s or r.move_claimed_at > 0
        for r in replicas
    ):
        return None
    by_stage = [[r for r in replicas if r.stage == s] for s in range(num_stages)]
    if any(not members or all(r.capacity <= 0 for r in members) for members in by_stage):
        return None  # an empty stage is a joiner's job (--stage auto); an unmeasured one, a later check's
    replicas = [_measured(r, by_stage[r.stage]) for r in replicas]
    by_stage = [[r for r in replicas if r.stage == s] for s in range(num_stages)]
    totals = stage_totals(replicas, num_stages)
    now_min = min(totals)
    target = min(range(num_stages), key=lambda s: (totals[s], s))
    if sum(r.throughput for r in by_stage[target]) < SATURATED * totals[target]:
        return None
    mean = [totals[s] / len(by_stage[s]) for s in range(num_stages)]
    best: Move | None = None
    for r in sorted(replicas, key=lambda r: r.peer_id):
        if mover is not None and r.peer_id != mover:
            continue
        if not r.movable or r.stage == target or len(by_stage[r.stage]) < 2 or now - r.moved_at < cooldown_s:
            continue
        after = list(totals)
        after[r.stage] -= r.capacity
        after[target] += r.capacity * mean[target] / mean[r.stage]
        move = Move(r.peer_id, r.stage, target, now_min, min(after))
        if best is None or move.throughput_after > best.throughput_after:
            best = move
    if best is None or now_min >= margin * best.throughput_after:
        return None
    return best


async def watch(
    *,
    me: str,
    read: Callable[[], Awaitable[list[Replica]]],
    claim: Callable[[float], Awaitable[None]],
    num_stages: int,
    margin: float,
    period_s: float,
    settle_s: float,
    cooldown_s: float,
    clock: Callable[[], float] = time.time,
) -> Move:
    """Check every `period_s` until a plan names us and our claim to it holds (module docstring);
    returns that move (the caller carries it out). `claim(t)` announces our claim made at unix
    time t, `claim(0.0)` withdraws it."""
    plan = functools.partial(plan_move, num_stages=num_stages, margin=margin, settle_s=settle_s, cooldown_s=cooldown_s)
    while True:
        await asyncio.sleep(period_s)
        try:
            replicas = await read()
        except Exception:  # noqa: BLE001 - a failed lookup is retried next period
            log.warning("rebalance: reading the swarm's records failed; retrying in %.0f s", period_s, exc_info=True)
            continue
        move = plan(replicas, now=clock())
        if move is not None:
            log.info("rebalance plan: %s%s", move, " (this node)" if move.peer_id == me else "")
            if move.peer_id == me and await _claim_holds(me, read, claim, plan, period_s, clock):
                return move


async def _claim_holds(
    me: str,
    read: Callable[[], Awaitable[list[Replica]]],
    claim: Callable[[float], Awaitable[None]],
    plan: Callable[..., Move | None],
    period_s: float,
    clock: Callable[[], float],
) -> bool:
    claimed_at = clock()
    await claim(claimed_at)
    await asyncio.sleep(period_s * random.uniform(1.0, 1.5))
    try:
        replicas = await read()
    except Exception:  # noqa: BLE001 - a failed lookup: not confirmed, the next period decides
        replicas = None
    if replicas is not None:
        earliest = min(
            [(claimed_at, me)]
            + [(r.move_claimed_at, r.peer_id) for r in replicas if r.move_claimed_at > 0 and r.peer_id != me]
        )
        again = plan([dataclasses.replace(r, move_claimed_at=0.0) for r in replicas], now=clock(), mover=me)
        if earliest[1] == me and again is not None:
            return True
        reason = (
            "an earlier claim by peer " + earliest[1][-8:]
            if earliest[1] != me
            else "our move no longer stands: the swarm is unsettled or the gain is below the margin"
        )
        log.info("rebalance: not moving after all (%s)", reason)
    await claim(0.0)
    return False
