"""Replicas of a stage that fell rounds apart get back in step.

With no barrier, a round pairs only replicas at the same boundary at the same time. Two replicas
whose starts differed by more than a round (a joiner that copied its donor's state while the donor
trained on, a restart, a slow start under load) would each match rounds the other is not in, and
every round of both would go solo for the rest of the run (seen in CI: every round of one of two
home nodes behind NAT). So:

- the one ahead, finding no partner, waits on in windows of `match_s` while another replica of the
  stage is at most `rounds` rounds behind and still moving (its announced inner step advances, or
  it is matching an earlier round), for at most `rounds` of its own round periods. With
  outer.overlap it trains on meanwhile; it blocks only at its next boundary, once;
- the one behind skips, at once, a round that no other replica can still be in (`nobody_to_wait_for`):
  it arrives at the round the other waits in as fast as it trains.

They then pair in every round that follows. A replica more than `rounds` behind is not waited for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from noloco_node.sync.pairing import announced_steps
from noloco_node.sync.ports import MatchingDirectory

MISSED_ROUNDS = 1
"""A drawn mate that never came is not waited for in this many rounds, doubling with each miss
until it pairs with us (an honest latecomer misses a round it was too far behind for; a peer that
only claims progress misses every time, so it costs a logarithmic number of rounds)."""


@dataclass(frozen=True)
class RoundView:
    """What a round asks the directory about its stage's other replicas, and how long it waits for an answer."""

    directory: MatchingDirectory
    stage: int
    me: str
    inner_step: int
    every: int
    round_index: int
    banned: Callable[[str], bool]
    timeout_s: float

    async def steps(self) -> dict[str, int]:
        """The inner step each replica announces (none where the directory cannot tell)."""
        return await announced_steps(self.directory, self.stage, timeout_s=self.timeout_s)

    async def matching(self, round_index: int) -> list[str] | None:
        """The other replicas, not banned, matching `round_index`; None where there is no answer."""
        try:
            peers = await asyncio.wait_for(self.directory.matching(self.stage, round_index), self.timeout_s)
        except Exception:  # noqa: BLE001 - no answer: the caller decides what that means
            return None
        return [p.peer_id for p in peers if p.peer_id != self.me and not self.banned(p.peer_id)]


ALONE, AHEAD = "alone", "replicas ahead"


async def nobody_to_wait_for(view: RoundView) -> str | None:
    """Why no other live replica of the stage can still take part in the round, or None: ALONE (a
    fresh lookup lists none), AHEAD (every other one announces an inner step at or past the next
    boundary and is not matching this round: an overlapped round keeps training to the next
    boundary while it matches). None too where the lookup cannot tell (no answer, or not even our
    own record)."""
    steps = await view.steps()
    if view.me not in steps:
        return None
    others = {peer: step for peer, step in steps.items() if peer != view.me and not view.banned(peer)}
    if any(step < view.inner_step + view.every for step in others.values()):
        return None
    if not others:
        return ALONE
    here = await view.matching(view.round_index)
    if here is None or set(here) & set(others):  # no answer: look for a partner as usual
        return None
    return AHEAD


@dataclass
class CatchUp:
    """How long a round that found no partner waits for replicas behind it (see the module)."""

    match_s: float
    heartbeat_s: float
    rounds: int
    """How many rounds behind a replica may be and still be waited for (NoLoCoSettings.catch_up_rounds)."""
    period_s: float | None = None
    """The time between this node's last two round starts: how long a round of training takes here."""
    stopping: bool = False
    """Set when the node stops (OuterSync.wind_down): nobody is waited for any more."""
    _last_start: float | None = None
    _missed: dict[str, tuple[int, int]] = field(default_factory=dict)  # peer -> (skipped until round, misses)
    _last_step: dict[str, int] = field(default_factory=dict)
    _moved_at: dict[str, float] = field(default_factory=dict)
    """When each replica was last seen moving (a new inner step, or in a round), kept across rounds:
    a replica that died keeps its record (and its step) until the record's TTL."""

    def round_started(self, now: float) -> None:
        if self._last_start is not None:
            self.period_s = now - self._last_start
        self._last_start = now

    def stop(self) -> None:
        self.stopping = True

    def missed(self, peer: str, round_index: int) -> None:
        """`peer` was waited for as this round's drawn mate and never came: it is not counted on
        its way for the next MISSED_ROUNDS rounds, twice as many each time it misses again before
        it pairs with us (a peer that announces progress it never makes cannot hold a replica back
        every round)."""
        _, times = self._missed.get(peer, (0, 0))
        self._missed[peer] = (round_index + 1 + MISSED_ROUNDS * 2**times, times + 1)

    def met(self, peer: str) -> None:
        """We paired with `peer`: its misses are forgiven."""
        self._missed.pop(peer, None)

    def extra_s(self) -> float:
        """How long past its first window a round may wait for replicas behind it: `rounds` of our
        round periods (one more window before a period is known; none with rounds = 0)."""
        if not self.rounds:
            return 0.0
        return self.match_s if self.period_s is None else max(self.match_s, self.rounds * self.period_s)

    def _stall_s(self, every: int) -> float:
        """How long an announced inner step may stand still before its replica counts as stuck: a few
        of its record's refreshes, and a few of our own steps."""
        step_s = 0.0 if self.period_s is None else self.period_s / every
        return max(self.match_s, 3 * self.heartbeat_s, 3 * step_s)

    async def laggards(self, view: RoundView) -> list[str]:
        """The other replicas of the stage on their way to the round, sorted: matching one of the
        `rounds` rounds before it, or announcing an inner step at most `rounds` rounds short of its
        boundary (or at it, between rounds) that moved within the stall time. A replica still in an
        earlier round counts as moving: an overlapped one waits for that round at its next boundary,
        where its step stands still. None while the node stops."""
        if not self.rounds or self.stopping:
            return []
        on_the_way: set[str] = set()
        now, oldest = time.monotonic(), view.inner_step - self.rounds * view.every
        for earlier in range(view.round_index - 1, max(view.round_index - 1 - self.rounds, -1), -1):
            for peer in await view.matching(earlier) or []:
                on_the_way.add(peer)
                self._moved_at[peer] = now
        for peer, step in (await view.steps()).items():
            if peer == view.me or view.banned(peer) or not oldest <= step <= view.inner_step:
                continue
            if self._last_step.get(peer) != step:
                self._last_step[peer], self._moved_at[peer] = step, now
            if now - self._moved_at[peer] < self._stall_s(view.every):
                on_the_way.add(peer)
        return sorted(p for p in on_the_way if self._missed.get(p, (0, 0))[0] <= view.round_index)
