"""A replica left rounds behind its stage copies the stage's state again, while it runs.

Replicas more than NoLoCoSettings.catch_up_rounds apart are not waited for (sync/catch_up.py). A
replica that fell that far behind after it joined (a laptop that slept, a process stopped, a link
down for minutes) would go solo every round for the rest of the run, "replicas ahead", its weights
drifting away from the stage's. So after BEHIND_ROUNDS rounds in a row that went solo that way,
with a live replica of the stage a round or more further on, the node copies the stage's state
again: node/serving.py drains it, it leaves and comes back on the same stage under the same
identity, and takes up a live replica's state (node/state_copy.py: the copy, and its top-up when
the copy took rounds), not its own checkpoint. A copy that still left the node behind (one that
takes longer than the top-up can make up) is not made again: the attention note says why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from noloco_node.sync.catch_up import AHEAD
from noloco_node.sync.state_fetch import agreed_step, claim_limit

if TYPE_CHECKING:
    from noloco_node.node.lifecycle import Node

log = logging.getLogger(__name__)

BEHIND_ROUNDS = 3
"""Solo rounds in a row, every other replica rounds ahead, before a node copies their state: one
more than the rounds the catch-up itself skips (NoLoCoSettings.catch_up_rounds, 2), so a replica
that pairing alone brings level never copies."""
RECOPY = "behind"
"""A move record's `why` for a copy of the node's own stage (a rebalancing move has none)."""


@dataclass(frozen=True)
class Recopy:
    """A move to the node's own stage, to copy the state its live replicas have (module doc)."""

    peer_id: str
    stage: int
    inner_step: int
    replicas_at: int
    """The inner step of the stage's live replica furthest along, when the copy was decided."""

    @property
    def source(self) -> int:
        return self.stage

    @property
    def target(self) -> int:
        return self.stage

    def __str__(self) -> str:
        behind = self.replicas_at - self.inner_step
        return (
            f"peer {self.peer_id[-8:]} stage {self.stage}: inner step {self.inner_step}, {behind} steps behind "
            f"the stage's live replicas (at {self.replicas_at}); copying their state"
        )


def behind_for(history: Sequence[dict], rounds: int = BEHIND_ROUNDS) -> bool:
    """The last `rounds` outer rounds all went solo because every other replica was rounds ahead."""
    latest = history[-rounds:]
    return len(latest) == rounds and all(r.get("outcome") != "paired" and r.get("reason") == AHEAD for r in latest)


def copy_again_in_vain(history: Sequence[dict], moves: Sequence[dict]) -> bool:
    """This node came here by copying its stage's state because it was behind, and has not paired
    since: that copy landed behind too, and another one would (module doc)."""
    return bool(moves) and moves[-1].get("why") == RECOPY and not any(r.get("outcome") == "paired" for r in history)


def replicas_ahead(others: Sequence, mine: int, every: int) -> list:
    """The other replicas a round or more ahead of inner step `mine`, when the stage's records
    agree it is that far on (sync/state_fetch.py agreed_step: a record claiming thousands of steps
    ahead of three honest replicas made the odd one out copy from it), none past their claim_limit."""
    steps = [r.inner_step for r in others]
    agreed, limit = agreed_step(steps), claim_limit(steps, every)
    if agreed is None or agreed - mine < every:
        return []
    return [r for r in others if every <= r.inner_step - mine and r.inner_step <= limit]


async def _answering(node: Node, ahead: list) -> list:
    """The replicas ahead (up to 4, furthest first) that answer where their records say they
    serve: leaving the stage for a copy nobody can give costs the node its place (a hostile-peer
    audit's record at a dead port made a lone replica leave, fail the copy and stall ~70 s)."""
    timeout_s = min(node.config.timeouts.rpc_s, 10.0)
    ahead = sorted(ahead, key=lambda r: -r.inner_step)[:4]
    answering = [r for r in ahead if await node.outer_client.answers(r.peer_id, timeout_s)]
    if not answering:
        log.info("stage %d's replicas ahead of this node do not answer: no copy of their state", node.stage_index)
    return answering


async def watch_behind(node: Node) -> None:
    """Until cancelled, or a move is asked for: after every outer round, ask for a Recopy when the
    node is behind its stage's live replicas as the module says."""
    every = node.config.outer.inner_steps_per_outer or 1
    seen = 0
    while not node.move_requested.is_set():
        await asyncio.sleep(node.config.timeouts.heartbeat_s)
        history = node.sync.counters.history
        if len(history) == seen or not behind_for(history):
            continue
        seen = len(history)
        if copy_again_in_vain(history, node.moves):
            continue
        try:
            replicas = await node.directory.replicas(node.stage_index, fresh=True)
        except Exception as exc:  # noqa: BLE001 - no answer now: the next round asks again
            log.debug("could not look up stage %d's replicas: %r", node.stage_index, exc)
            continue
        mine = node.worker.inner_steps
        ahead = replicas_ahead([r for r in replicas if r.peer_id != node.peer_id], mine, every)
        if not ahead or node.move_requested.is_set() or not (answering := await _answering(node, ahead)):
            continue
        furthest = max(r.inner_step for r in answering)
        node.move = Recopy(node.peer_id, node.stage_index, mine, furthest)
        node.events.emit("recopy_planned", stage=node.stage_index, inner_step=mine, replicas_at=furthest)
        log.warning(
            "the last %d outer rounds went solo: stage %d's other replicas are %d inner steps ahead and pair "
            "without this node; leaving the stage to copy their state, and back",
            BEHIND_ROUNDS,
            node.stage_index,
            furthest - mine,
        )
        node.move_requested.set()
        return
