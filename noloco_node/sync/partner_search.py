"""How a NoLoCo round finds its partner (the matching half of sync/noloco.py, PAIR-v1 in
docs/architecture.md): the round's drawn pairing first, then random proposals within
`timeouts.match_s`, then, while a replica behind us is on its way, more windows (sync/catch_up.py).

The draw counts replicas on their way besides those matching now, so a replica that fell behind
a pair in step is drawn too, and the one drawn with it waits for it: otherwise the pair would
meet every round and the one behind would stay the odd one out for the rest of the run (seen: a
joiner 1.5 rounds behind two home nodes, 0 of 5 rounds paired). While a node waits for its drawn
mate it refuses other proposals (`awaiting`, read by NoLoCoSync.decide), so the draw holds.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING

from noloco_node.pipeline.ports import Peer
from noloco_node.pipeline.router import Bans
from noloco_node.sync.catch_up import AHEAD, CatchUp, RoundView, nobody_to_wait_for
from noloco_node.sync.pairing import drawn_mate, replica_count, wait_at_most
from noloco_node.sync.ports import MatchingDirectory


class PartnerSearch:
    """Mixed into NoLoCoSync, whose per-round state it reads and whose `_propose` it calls."""

    if TYPE_CHECKING:
        peer_id: str
        stage: int
        every: int
        match_s: float
        directory: MatchingDirectory
        bans: Bans
        rng: random.Random
        catch_up: CatchUp
        done: asyncio.Event
        partner: str | None
        awaiting: str | None
        _reason: str

        async def _propose(self, peer: Peer, inner_step: int, deadline: float, tried: set[str]) -> None: ...
        def _exchange_s(self, peer_id: str) -> float: ...

    async def _find_partner(self, inner_step: int, round_index: int, deadline: float, tried: set[str]) -> None:
        """The drawn mate first, then random proposals until `deadline`, then more windows while a
        replica behind us is on its way, then the end of a session we accepted; nothing more when
        no other replica can still reach this round."""
        view = RoundView(
            self.directory,
            self.stage,
            self.peer_id,
            inner_step,
            self.every,
            round_index,
            self.bans.is_banned,
            timeout_s=min(2.0, self.match_s),
        )
        odd_one_out = await self._propose_to_drawn_mate(view, deadline, tried)
        if self.partner is None and not self.done.is_set():
            if why := await nobody_to_wait_for(view):  # alone, or the others are rounds ahead: solo now
                if why == AHEAD:
                    self._reason = AHEAD  # the round's history says so; a node that stays behind is told
                return
        if self.rng.random() < 0.5:  # passive for a short random while, so proposals do not all cross
            await wait_at_most(self.done, min(self.rng.uniform(0, 0.1 * self.match_s), deadline - time.monotonic()))
        # The odd one out of a draw that counted the replicas on their way has nobody left to wait for.
        waits_until, poll_s = deadline + (0.0 if odd_one_out else self.catch_up.extra_s()), 0.1
        while True:
            await self._match(inner_step, round_index, deadline, tried, poll_s)
            if self.done.is_set() or self.partner is not None or time.monotonic() >= waits_until:
                break
            if not await self.catch_up.laggards(view):
                break
            # A replica behind us is on its way: fewer lookups while we wait for it.
            deadline, poll_s = min(waits_until, time.monotonic() + self.match_s), 0.5
        if self.partner is not None and not self.done.is_set():
            # A session we accepted is still streaming: its server side ends it within a deadline
            # derived from the partner's link and finishes the round; this wait only backs that up.
            await wait_at_most(self.done, self.match_s + self._exchange_s(self.partner))

    async def _match(
        self, inner_step: int, round_index: int, deadline: float, tried: set[str], poll_s: float = 0.1
    ) -> None:
        """Propose to replicas matching this round, one at a time, until the round is done or `deadline`."""
        while not self.done.is_set() and time.monotonic() < deadline:
            if self.partner is not None:  # an accepted incoming session is running
                await wait_at_most(self.done, deadline - time.monotonic())
                continue
            candidates = [
                p
                for p in await self.directory.matching(self.stage, round_index)
                if p.peer_id != self.peer_id and p.peer_id not in tried and not self.bans.is_banned(p.peer_id)
            ]
            if not candidates:
                await wait_at_most(self.done, min(poll_s, deadline - time.monotonic()))
                continue
            # Prefer a partner we reach without a relay; a relayed one only when nobody else matches.
            unrelayed = [p for p in candidates if p.reach != "relayed"]
            await self._propose(self.rng.choice(unrelayed or candidates), inner_step, deadline, tried)

    async def _propose_to_drawn_mate(self, view: RoundView, deadline: float, tried: set[str]) -> bool:
        """The round's random pairing, drawn the same way on every replica: after a short gather
        window, the replicas matching this round, and those on their way to it when some are
        missing, are shuffled with a seed of (stage, round) and paired in that order; the lower
        peer id of each pair proposes, the other waits for it. Returns whether this node is the odd
        one out of a draw that counted replicas on their way.

        Without it, who pairs with whom follows who reaches the round first, and equal-speed
        replicas reach it in the same order every round: the same pairs form again and again, so
        the swarm splits into pairs that never mix (seen in the gamma x codec reproduction). When
        views differ (a late replica), the random proposals of _find_partner take over."""
        inner_step, round_index = view.inner_step, view.round_index
        gather_end = min(deadline, time.monotonic() + self._gather_s())
        expected = await replica_count(self.directory, self.stage)
        while True:
            if self.done.is_set() or self.partner is not None:
                return False
            matching = {
                p.peer_id: p
                for p in await self.directory.matching(self.stage, round_index)
                if p.peer_id != self.peer_id and not self.bans.is_banned(p.peer_id)
            }
            if len(matching) + 1 >= expected or time.monotonic() >= gather_end:
                break  # everyone we know of is here, or the window is over
            await wait_at_most(self.done, min(0.05, gather_end - time.monotonic()))
        coming: list[str] = []
        if len(matching) + 1 < expected:
            coming = [peer_id for peer_id in await self.catch_up.laggards(view) if peer_id not in matching]
        mate = drawn_mate([*matching, *coming, self.peer_id], self.peer_id, self.stage, round_index)
        if mate is None:
            return bool(coming)  # the odd one out this round: it proposes at random
        self.awaiting = mate
        try:
            if mate in matching:
                await self._meet(matching[mate], inner_step, deadline, tried)
            else:
                await self._wait_for_mate(mate, view, deadline, tried)
        finally:
            self.awaiting = None
        return False

    def _gather_s(self) -> float:
        """How long a round's draw waits for the replicas it knows of to reach the round."""
        return min(1.0, 0.1 * self.match_s)

    async def _meet(self, mate: Peer, inner_step: int, deadline: float, tried: set[str]) -> None:
        """The lower peer id of the drawn pair proposes; the other waits a little for it."""
        if self.peer_id < mate.peer_id:
            await self._propose(mate, inner_step, deadline, tried)
        else:
            await wait_at_most(self.done, min(2 * self._gather_s(), deadline - time.monotonic()))

    async def _wait_for_mate(self, mate: str, view: RoundView, deadline: float, tried: set[str]) -> None:
        """Our drawn mate is on its way: until it matches this round, while it stays on its way,
        within the catch-up bound; then the usual meeting, with a window of its own."""
        until, look_again = deadline + self.catch_up.extra_s(), time.monotonic() + self.match_s
        while not self.done.is_set() and self.partner is None and time.monotonic() < until:
            here = {p.peer_id: p for p in await self.directory.matching(self.stage, view.round_index)}
            if mate in here:
                window_end = max(deadline, time.monotonic() + self.match_s)
                await self._meet(here[mate], view.inner_step, window_end, tried)
                return
            if time.monotonic() >= look_again:
                if mate not in await self.catch_up.laggards(view):
                    break
                look_again = time.monotonic() + self.match_s
            await wait_at_most(self.done, min(0.5, until - time.monotonic()))
        if self.partner is None and not self.done.is_set():
            # It never came: a replica that only claims to be on its way must not cost a round each time.
            self.catch_up.missed(mate, view.round_index)
