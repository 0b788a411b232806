"""The parts of a NoLoCo round (sync/noloco.py) that hold none of its per-round state: the
method's settings, the round's drawn pairing, what the directory tells of the stage's replicas
(their count, their inner steps), a wait bounded by the round's deadline, and the distance check a
partner's snapshot must pass before the pair step applies it."""

from __future__ import annotations

import asyncio
import collections
import random
import statistics
from dataclasses import dataclass

from torch import Tensor

from noloco_node.optim.compress import ErrorFeedback
from noloco_node.optim.state import OuterState
from noloco_node.runtime.compute import ComputeThread
from noloco_node.sync.ports import MatchingDirectory
from noloco_node.sync.snapshot import THETA, Frozen, check_snapshot, fill_slices, unpack


@dataclass(frozen=True, kw_only=True)
class NoLoCoSettings:
    match_s: float
    """How long a round looks for a partner (timeouts.match_s) before it takes the solo step."""
    payload: str | None = None
    """Forces the snapshot form ("theta" or "phi+delta"; tests, benchmarks); None lets the node
    choose (theta wherever it loses nothing)."""
    run_seed: int = 0
    """run.seed, the same on every replica of a run: draws the slices of a sliced phi."""
    heartbeat_s: float = 10.0
    """timeouts.heartbeat_s: how often a replica's record (its inner step) is refreshed."""
    catch_up_rounds: int = 2
    """How many rounds behind a replica may be and still be waited for (sync/catch_up.py); 0 = none."""


async def wait_at_most(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` has passed (no wait at all when it is not positive)."""
    if timeout_s > 0:
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


def drawn_mate(peer_ids: list[str], me: str, stage: int, round_index: int) -> str | None:
    """`me`'s mate in the round's pairing of `peer_ids`: shuffled with a seed of (stage, round,
    count), paired in that order; None for the odd one out. The same on every replica that sees
    the same ids, and different from round to round."""
    ids = sorted(set(peer_ids))
    random.Random(f"{stage}:{round_index}:{len(ids)}").shuffle(ids)
    index = ids.index(me)
    mate = index + 1 if index % 2 == 0 else index - 1
    return ids[mate] if mate < len(ids) else None


async def replica_count(directory: MatchingDirectory, stage: int) -> int:
    """The replicas `stage` has, where the directory can count them (0 where it cannot)."""
    count = getattr(directory, "replica_count", None)
    try:
        return await count(stage) if count is not None else 0
    except Exception:  # noqa: BLE001 - unknown: wait out the whole gather window
        return 1 << 30


async def announced_steps(directory: MatchingDirectory, stage: int, *, timeout_s: float) -> dict[str, int]:
    """The inner step each replica of `stage` announces, where the directory can tell (else none)."""
    steps = getattr(directory, "inner_steps", None)
    if steps is None:
        return {}
    try:
        return await steps(stage, timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - unknown: this round ends as it would have
        return {}


class PartnerDistances:
    """How far a partner's snapshot may be from ours (check_snapshot), by the distances of the
    last honest partners: their median, so one liar among them cannot move the bound, and an
    honest swarm's spread keeps passing once our own drift shrinks."""

    def __init__(self, max_distance_ratio: float) -> None:
        self.max_distance_ratio = max_distance_ratio
        self._accepted: collections.deque[float] = collections.deque(maxlen=8)
        self._largest_drift = 0.0

    def saw_drift(self, drift: float) -> None:
        """Our own drift ||Delta|| at a round's freeze, paired or not: the bound never falls below
        the largest one. A replica that went solo for long (a joiner left behind) has no accepted
        partners to go by, and with its learning rate decayed its drift now is ~10x smaller than the
        spread it built up: it refused every honest partner (seen: 6.35 against a bound of 4.2)."""
        self._largest_drift = max(self._largest_drift, drift)

    def typical(self) -> float:
        """The median distance of the last accepted partners (0 before any)."""
        return statistics.median(self._accepted) if self._accepted else 0.0

    def problem(self, state: OuterState, peer: dict) -> str | None:
        """Why the partner's snapshot `peer` is refused, or None (then its distance is remembered)."""
        measured: dict[str, float] = {}
        problem = check_snapshot(
            state,
            peer,
            max_distance_ratio=self.max_distance_ratio,
            typical_distance=max(self.typical(), self._largest_drift),
            distances=measured,
        )
        if problem is None:
            self._accepted.append(measured["fast"])
        return problem


def partner_snapshot(state: OuterState, frozen: Frozen, received: dict[str, Tensor]) -> dict:
    """The partner's snapshot as the pair step reads it: unpacked from the round's payload form,
    with the slices it did not send filled from ours."""
    return fill_slices(state, unpack(received, frozen.payload, list(state.params)), frozen.slices)


async def apply_pair_step(
    compute: ComputeThread, state: OuterState, frozen: Frozen, peer: dict, feedback: ErrorFeedback
) -> None:
    """The pair update with the partner's checked snapshot `peer`, on the compute thread."""
    if frozen.payload == THETA:
        own = {name: theta for name, (_, theta) in frozen.own.items()}
        await compute.run(state.apply_noloco, [peer], own, frozen.theta)
    else:
        await compute.run(state.apply_noloco_sent, [peer], frozen.own, frozen.theta)
        feedback.commit(frozen.residual)  # our pair step used what we sent: keep what it left out
