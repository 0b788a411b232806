"""`join --stage auto` when several volunteers join at once: claim, settle, then agree.

Picking the weakest stage alone is a race: two joiners that read the DHT in the same second see
the same weakest stage and both take it, though the swarm needed one on each. So a joiner first
*claims* the stage it would pick, a record with status `joining` under that stage's key (never
routed to), waits `settle_s` for simultaneous claims to land in the DHT, and reads them back:

- a claim made more than `settle_s` before ours is *settled*: its owner decided without seeing us,
  so its stage counts as taken, like a replica of its own;
- a claim made more than `settle_s` after ours is ignored: its owner counts ours as settled
  (CI saw two joiners both yield when a slow lookup showed the earlier one the later claim);
- the rest (ours included) are contenders, who all see one another: each walks them in peer-id
  order, giving each the weakest stage left and counting it as a replica there. Everyone runs the
  same walk on the same view, so they agree without talking, and two contenders land on two
  stages whenever the swarm needs that.

A claimant is counted by its claim alone, never also as the replica it may have become since: a
contender that decided first starts serving within a second, and a joiner that read the claims
before that and the replicas after would count it twice and land on the same stage (seen in a full
suite run: two simultaneous joiners both on stage 0 of [2, 2]).

A joiner whose stage changed re-claims it (and withdraws the old claim) before building its stage.
What is left to chance: claims that reach the DHT more than `settle_s` apart in a way that neither
joiner sees the other's in time (a lookup slower than the settle window); each then still picks a
weakest stage, as one joiner alone would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from noloco_node.runtime.throughput import weakest_stage
from noloco_node.runtime.node_status import Status

log = logging.getLogger(__name__)
CLAIM_SETTLE_S = 3.0
"""How long a joiner waits between claiming and reading the others' claims: well above a DHT
store's latency on a live swarm, and short next to building a stage."""


@dataclass(frozen=True)
class Claim:
    peer_id: str
    stage: int
    claimed_at: float


def _typical(capacities: list[list[float]]) -> float:
    """What a newcomer is assumed to sustain: the mean measured capacity (0 = none measured)."""
    known = [c for caps in capacities for c in caps if c > 0]
    return sum(known) / len(known) if known else 0.0


def _capacities(serving: Sequence[Mapping[str, float]], leave_out: Collection[str] = ()) -> list[list[float]]:
    return [[c for peer, c in stage.items() if peer not in leave_out] for stage in serving]


def assign_stage(
    serving: Sequence[Mapping[str, float]], claims: Sequence[Claim], me: str, claimed_at: float, settle_s: float
) -> int:
    """Our stage, given each stage's serving replicas (peer id -> measured capacity) and every
    joiner's claim; a claimant among the replicas counts by its claim only."""
    caps = _capacities(serving, {claim.peer_id for claim in claims})
    typical = _typical(caps)
    contenders = {me}
    for claim in claims:
        if claim.peer_id == me or not 0 <= claim.stage < len(caps):
            continue
        if claim.claimed_at < claimed_at - settle_s:
            caps[claim.stage].append(typical)
        elif claim.claimed_at <= claimed_at + settle_s:
            contenders.add(claim.peer_id)
        # A claim made more than settle_s after ours is one we saw only because our lookup was slow:
        # its owner counts ours as settled and yields to it, so we must not yield to it too.
    for peer_id in sorted(contenders):
        stage = weakest_stage(caps)
        if peer_id == me:
            return stage
        caps[stage].append(typical)
    raise AssertionError("unreachable: we are among the contenders")


async def claim_stage(
    *,
    serving: Callable[[], Awaitable[list[dict[str, float]]]],
    claims: Callable[[], Awaitable[list[Claim]]],
    announce_claim: Callable[[int, int | None, float], Awaitable[None]],
    me: str,
    settle_s: float,
    clock: Callable[[], float] = time.time,
) -> int:
    """Claim, settle, agree (module docstring). `announce_claim(stage, withdrawn_stage, claimed_at)`
    stores our joining record (and a leaving one under a stage we claimed before); `serving()`
    maps each stage's live replicas to their measured capacities."""
    claimed_at = clock()
    first = weakest_stage(_capacities(await serving()))
    await announce_claim(first, None, claimed_at)
    await asyncio.sleep(settle_s)
    seen = await claims()
    stage = assign_stage(await serving(), seen, me, claimed_at, settle_s)
    others = sorted((c.peer_id[-8:], c.stage) for c in seen if c.peer_id != me)
    log.info(
        "stage auto: claimed stage %d, other joiners' claims %s%s -> stage %d",
        first,
        others or "none",
        "" if stage == first else " (the choice changed while it settled)",
        stage,
    )
    if stage != first:
        await announce_claim(stage, first, claimed_at)
    return stage


async def claim_stage_in(
    directory, make_record: Callable[[int, str, float], object], *, ttl_s: float, settle_s: float = CLAIM_SETTLE_S
) -> int:
    """claim_stage over the DHT directory (dht/directory.py): claims are records with status
    joining, made by `make_record(stage, status, claimed_at)`, withdrawn with status leaving; they
    live `ttl_s`, long enough to outlast building the stage."""

    async def claims() -> list[Claim]:
        return [Claim(r.peer_id, r.stage, r.updated_at) for r in await directory.claims()]

    async def serving() -> list[dict[str, float]]:
        return [
            {r.peer_id: r.capacity for r in await directory.replicas(s, fresh=True)}
            for s in range(directory.identity.num_stages)
        ]

    async def announce_claim(stage: int, withdrawn: int | None, claimed_at: float) -> None:
        for status, where in ((Status.LEAVING, withdrawn), (Status.JOINING, stage)):
            if where is not None:
                await directory.announce(make_record(where, status, claimed_at), ttl_s=ttl_s)

    return await claim_stage(
        serving=serving,
        claims=claims,
        announce_claim=announce_claim,
        me=directory.peer_id,
        settle_s=settle_s,
    )
