"""Next-hop choice: random live replicas of the next stage, minus banned peers.

Four policies (`pipeline.routing`; capacity is the default, dp and diloco always use balanced):
- capacity (SWARM's stochastic wiring): each microbatch draws the next replica at random with
  probability proportional to its measured capacity (runtime/throughput.py, from its record), so a
  slow replica gets fewer microbatches and none is starved. Until every candidate is measured, or
  while their capacities lie within CAPACITY_SPREAD of each other, it is the random policy below.
- balanced (the reference's routing): microbatch k leaving stage p goes from the sender at
  index d among its stage's replicas to index pi_{k,p}[d] of the next stage, pi a permutation
  seeded by (run seed, k, p) that every sender computes alike. Each hop is random, and when the
  two stages have the same live replicas and their senders issue the same microbatch numbers,
  every receiver gets exactly one microbatch per number: replicas of a stage process equal
  shares and step in lockstep, which the data-parallel baseline needs to be exact and pairing
  likes. When the memberships differ (a replica died or joined), it falls back to:
- random: each sender walks a freshly shuffled cycle of the next stage's replicas, so its own
  load spreads evenly though the receivers' totals need not be equal.
- fixed: no randomness, the ablation the paper compares random routing with: the sender at
  index d always sends to index d mod n of the next stage (D fixed pipelines when stages match).
  A retry after a failure goes to a random other replica.

Replicas reached through a relay (their record says `relayed`) are drawn with weight
RELAYED_WEIGHT against 1 for the others, as Petals does: still random, but the relay (a volunteer's
bandwidth, an extra hop) carries a smaller share.

A peer that fails a call is banned locally with exponential backoff (1 s, 2 s, 4 s ... up to
`max_ban_s`), independent of what the DHT says; a success clears its record. A peer that took a
microbatch and sent no gradient back within timeouts.microbatch_s is shunned apart from that (a
call's success does not clear it): for that long, doubling up to LOST_MAX_S, while any other
replica is usable. A replica that acknowledges every forward and answers none (a black hole whose
record claims a huge capacity, a hostile-peer audit) so loses the traffic after one timeout.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass

from noloco_node.pipeline.ports import Peer
from noloco_node.runtime.throughput import routing_weights


RELAYED_WEIGHT = 0.2
LOST_MAX_S = 600.0  # the longest a replica that lost our microbatches is shunned
# Capacity routing weighs replicas only when their measured capacities differ by at least this
# ratio; closer than that they are noise around one speed, and the equal shares of the shuffled
# cycle keep the replicas of a stage at the same inner step (NoLoCo pairs replicas of one round).
CAPACITY_SPREAD = 1.5


@dataclass
class _Ban:
    until: float
    strikes: int


class Bans:
    def __init__(self, *, base_s: float = 1.0, max_ban_s: float = 60.0, clock=time.monotonic) -> None:
        self.base_s, self.max_ban_s, self.clock = base_s, max_ban_s, clock
        self._bans: dict[str, _Ban] = {}
        self.total = 0
        self.ever: set[str] = set()  # every peer banned at least once (stats; bounded by the peers we route to)

    def ban(self, peer_id: str) -> float:
        strikes = self._bans[peer_id].strikes + 1 if peer_id in self._bans else 1
        duration = min(self.max_ban_s, self.base_s * 2 ** (strikes - 1))
        self._bans[peer_id] = _Ban(until=self.clock() + duration, strikes=strikes)
        self.total += 1
        self.ever.add(peer_id)
        return duration

    def is_banned(self, peer_id: str) -> bool:
        ban = self._bans.get(peer_id)
        return ban is not None and self.clock() < ban.until

    def clear(self, peer_id: str) -> None:
        self._bans.pop(peer_id, None)

    def banned_peers(self) -> list[str]:
        """Every peer banned at least once, for stats."""
        return sorted(self.ever)

    def active(self) -> int:
        return sum(1 for peer in self._bans if self.is_banned(peer))


class Router:
    def __init__(self, bans: Bans, rng: random.Random | None = None, *, by_capacity: bool = False) -> None:
        self.bans, self.by_capacity = bans, by_capacity
        # Picks drawn while every candidate's capacity was measured, and the probability mass the
        # measured capacities gave each peer over those picks: the routing distribution in stats.
        self.measured_picks: Counter = Counter()
        self.measured_shares: Counter = Counter()
        self.rng = rng or random.Random()
        self._cycle: list[str] = []
        self._lost: dict[str, _Ban] = {}
        self.clock = bans.clock

    def lost(self, peer_id: str, timeout_s: float) -> float:
        """`peer_id` took a microbatch and sent no gradient back within `timeout_s`: shun it that
        long, doubling with each loss (up to LOST_MAX_S); returns for how long. The other
        microbatches it held then time out together: one loss, not one per microbatch (live, a
        batch of 8 took a black hole to the 600 s cap at once)."""
        now, known = self.clock(), self._lost.get(peer_id)
        if known is not None and now < known.until:
            return known.until - now
        strikes = known.strikes + 1 if known is not None else 1
        duration = min(LOST_MAX_S, timeout_s * 2 ** (strikes - 1))
        self._lost[peer_id] = _Ban(until=now + duration, strikes=strikes)
        return duration

    def returned(self, peer_id: str) -> None:
        """A gradient came back through `peer_id`: it loses no more than others do."""
        self._lost.pop(peer_id, None)

    def shunned(self, peer_id: str) -> bool:
        lost = self._lost.get(peer_id)
        return lost is not None and self.clock() < lost.until

    def _refused(self, peer_id: str) -> bool:
        return self.bans.is_banned(peer_id) or self.shunned(peer_id)

    def pick_permuted(
        self, candidates: list[Peer], senders: list[str], me: str, seed: str, *, ignore_bans: bool = False
    ) -> Peer | None:
        """The balanced choice for the microbatch `seed` names: None when it does not apply (the
        stages differ in size, we are not among the senders) or its receiver is banned here (unless
        `ignore_bans`: in lockstep no other receiver will do)."""
        if len(candidates) != len(senders) or me not in senders:
            return None
        receivers = sorted(candidates, key=lambda p: p.peer_id)
        order = list(range(len(receivers)))
        random.Random(seed).shuffle(order)  # str seeds hash the same in every process
        peer = receivers[order[sorted(senders).index(me)]]
        return None if self._refused(peer.peer_id) and not ignore_bans else peer

    def pick_fixed(self, candidates: list[Peer], senders: list[str], me: str) -> Peer | None:
        """The fixed choice: the sender at index d among its stage's replicas always sends to index
        d mod n of the next stage, so equal stages form D fixed pipelines (the paper's baseline for
        random routing). None when we are not among the senders or that receiver is banned."""
        if not candidates or me not in senders:
            return None
        receivers = sorted(candidates, key=lambda p: p.peer_id)
        peer = receivers[sorted(senders).index(me) % len(receivers)]
        return None if self._refused(peer.peer_id) else peer

    def pick(self, candidates: list[Peer], exclude: set[str] = frozenset()) -> Peer | None:
        usable = {p.peer_id: p for p in candidates if p.peer_id not in exclude and not self.bans.is_banned(p.peer_id)}
        usable = {k: p for k, p in usable.items() if not self.shunned(k)} or usable  # the only ones left: still
        if not usable:
            return None
        measured = [p.capacity for p in usable.values()]
        weigh = self.by_capacity and min(measured) > 0 and max(measured) >= CAPACITY_SPREAD * min(measured)
        if len(usable) > 1 and (weigh or any(p.reach == "relayed" for p in usable.values())):
            peers = sorted(usable.values(), key=lambda p: p.peer_id)
            weights = routing_weights(p.capacity for p in peers) if weigh else [1.0] * len(peers)
            weights = [w * (RELAYED_WEIGHT if p.reach == "relayed" else 1.0) for w, p in zip(weights, peers)]
            peer = self.rng.choices(peers, weights)[0]
            if weigh:
                self.measured_picks[peer.peer_id] += 1
                total = sum(weights)
                for p, w in zip(peers, weights):
                    self.measured_shares[p.peer_id] += w / total
            return peer
        while self._cycle:
            peer_id = self._cycle.pop()
            if peer_id in usable:
                return usable[peer_id]
        cycle = sorted(p.peer_id for p in candidates)
        self.rng.shuffle(cycle)
        self._cycle = cycle
        while self._cycle:
            peer_id = self._cycle.pop()
            if peer_id in usable:
                return usable[peer_id]
        return None
