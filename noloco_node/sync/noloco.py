"""NoLoCo outer step over the network: pair with one random replica of the stage, exchange
snapshots, apply the pair update; anything else ends in the solo step. No global barrier.

Pairing (PAIR-v1, docs/architecture.md: The outer step and pairing): at its boundary a node freezes
its snapshot and marks itself `matching` for round r in the DHT. With probability 1/2 it proposes at
once, else after a short random passive wait (up to 10% of match_s). A node is in at most one pair
per round: while its own proposal is pending it refuses others, except the crossing case (A->B and
B->A at once), which both sides resolve the same way: the session proposed by the smaller peer id
wins. Received snapshots are validated (finite, within a distance bound) before use; a bad one is
rejected, its sender banned, and the node takes the solo step.

What travels (snapshot.py): slow weights phi and outer delta Delta, each with its own codec
(outer.codec_phi, outer.codec_delta), so any alpha, beta, gamma runs; or, when gamma == beta and
one dense codec serves both, theta alone (the same update in half the bytes). The round's history
entry names the form ("payload") with its bytes and the codec's relative error. A top-k Delta
keeps what it dropped as a residual on this node (optim/compress.py), committed only when the
pair step used what was sent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time

from torch import Tensor

from noloco_node.config import OuterConfig
from noloco_node.errors import InvalidPayload, NodeError, PeerBusy, PoisonedPayload
from noloco_node.optim.compress import ErrorFeedback
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.ports import Peer
from noloco_node.pipeline.router import Bans
from noloco_node.runtime.node_status import Status
from noloco_node.sync.catch_up import CatchUp
from noloco_node.sync.partner_search import PartnerSearch
from noloco_node.sync.ports import Decision, MatchingDirectory, MethodTraits, OuterSync, PairAnswer
from noloco_node.sync.ports import PairingTransport, PairProposal, SyncParts
from noloco_node.sync.pairing import (
    NoLoCoSettings,
    PartnerDistances,
    apply_pair_step,
    partner_snapshot,
)
from noloco_node.sync.snapshot import NON_FINITE, PHI_DELTA, THETA, Frozen, SliceRound, choose_payload, freeze

log = logging.getLogger(__name__)


class NoLoCoSync(PartnerSearch, OuterSync):
    # Replicas pair and serve FetchState, so a joiner (or a replica moving stages) copies a live
    # replica's state; no group of fixed size holds a replica to its stage.
    traits = MethodTraits("noloco", syncs=True, outer_rounds=True, donates_state=True, movable=True)

    def __init__(
        self,
        state: OuterState,
        config: OuterConfig,
        parts: SyncParts,
        *,
        transport: PairingTransport,
        directory: MatchingDirectory,
        settings: NoLoCoSettings,
        bans: Bans | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """`config.codec_phi` encodes phi (or theta), `config.codec_delta` the outer delta;
        `settings` (sync/pairing.py) bound the matching and may force the snapshot form."""
        super().__init__()
        self.state, self.parts, self.transport, self.directory = state, parts, transport, directory
        self.compute, self.faults, self.set_status = parts.compute, parts.faults, parts.set_status
        self.peer_id, self.stage = parts.peer_id, parts.stage
        self.every, self.overlap = config.inner_steps_per_outer, config.overlap
        self.codec_phi, self.codec_delta = config.codec_phi, config.codec_delta
        self.payload = settings.payload or choose_payload(state, self.codec_phi, self.codec_delta)
        if self.payload == THETA and choose_payload(state, self.codec_phi, self.codec_delta) != THETA:
            raise ValueError(
                "theta alone carries the pair update only with gamma == beta and one dense codec for phi and delta"
            )
        self.feedback = ErrorFeedback()
        self.run_seed = settings.run_seed
        self.distances = PartnerDistances(config.max_distance_ratio)
        self.match_s = settings.match_s
        self.catch_up = CatchUp(settings.match_s, settings.heartbeat_s, settings.catch_up_rounds)
        self.bans = bans or Bans()
        self.rng = rng or random.Random(self.peer_id + "outer")
        self.round: int | None = None
        self._announced_round = 0
        self.matching = False
        self.partner: str | None = None
        self.outgoing: str | None = None
        self.awaiting: str | None = None  # our drawn mate, while we wait for it (sync/partner_search.py)
        self.done = asyncio.Event()  # the round's update has been applied
        self.claimed = False  # a completion (pair or solo) is under way for this round
        self._frozen: Frozen | None = None
        self._round_task: asyncio.Task | None = None

    # ---- OuterSync -----------------------------------------------------------------------
    async def at_boundary(self, inner_step: int) -> None:
        """Every H inner steps, a round. Blocking (the default): returns when its update is applied.
        With outer.overlap: returns once the round is under way; training goes on, and the update
        is applied when the exchange completes. A round still running at the next boundary is
        waited for there: one round at a time, never more than one behind."""
        if inner_step % self.every:
            return
        # Rounds share this object's per-round state: a second caller must not start one while
        # another does (the node's boundary takes calls one at a time; this holds without it too).
        while self._round_task is not None and not self._round_task.done():
            await asyncio.shield(self._round_task)
        task = self._round_task = self._track(asyncio.ensure_future(self._round(inner_step, inner_step // self.every)))
        if not self.overlap:
            await asyncio.shield(task)

    def may_skip_round(self, inner_step: int) -> bool:
        """A pair round: left out, its partner pairs with another replica or goes solo."""
        return inner_step % self.every == 0

    async def _round(self, inner_step: int, round_index: int) -> None:
        await self.outer_step(inner_step, round_index)
        self.parts.emit("outer_round", **self.counters.history[-1])

    @property
    def outer_round(self) -> int:
        return self._announced_round

    @property
    def bytes_sent(self) -> int:
        return self.transport.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.transport.bytes_received

    @property
    def responder(self) -> "NoLoCoSync":
        return self

    def round_bound_s(self) -> float:
        """The round under way ends within its matching windows, its wait for replicas catching up,
        the wait for a session we accepted (a window and the transfer's deadline at the partner's
        link) and 10 s to freeze and apply."""
        running = self._round_task is not None and not self._round_task.done()
        if not running:
            return 0.0
        return 3 * self.match_s + self.catch_up.extra_s() + self._exchange_s(self.partner or "") + 10.0

    def wind_down(self) -> None:
        self.catch_up.stop()

    def _exchange_s(self, peer_id: str) -> float:
        payload = self._frozen.snapshot.payload_bytes if self._frozen is not None else 0
        return self.transport.exchange_deadline_s(peer_id, 2 * payload)

    def start_at(self, round_index: int) -> None:
        """A joiner that copied a replica's state carries on from that replica's round."""
        self._announced_round = round_index

    async def close(self) -> None:
        await self.transport.close()

    # ---- responder side (sync.ports.PairingResponder) ------------------------------------
    def decide(self, proposal: PairProposal) -> PairAnswer:
        if proposal.sends_slow_weights != (self.payload == PHI_DELTA):
            return PairAnswer(
                Decision.MISMATCH,
                f"snapshot forms differ: this node sends {self.payload} (outer gamma or codecs differ)",
            )
        if not self.matching or self.round is None:
            return PairAnswer(Decision.BUSY, "not matching")
        if proposal.round != self.round:
            return PairAnswer(Decision.WAIT if proposal.round > self.round else Decision.BUSY, f"at round {self.round}")
        if self.partner is not None or self.claimed:
            return PairAnswer(Decision.BUSY, "already paired this round")
        if self.bans.is_banned(proposal.peer_id):
            return PairAnswer(Decision.BUSY, "banned")
        if self.awaiting is not None and proposal.peer_id != self.awaiting:
            return PairAnswer(Decision.BUSY, "waiting for the round's drawn mate")
        if self.outgoing is not None and not (self.outgoing == proposal.peer_id and proposal.peer_id < self.peer_id):
            return PairAnswer(Decision.BUSY, "own proposal pending")
        self.partner = proposal.peer_id
        return PairAnswer(Decision.ACCEPT)

    def frozen(self):
        return self._frozen.snapshot, self._frozen.expected, self.codec_phi

    def screen(self, received: dict[str, Tensor]) -> None:
        """The partner's snapshot judged before our receipt goes out (as responder and as
        initiator), so a refused one ends the exchange with an error on both sides and neither
        applies the pair step; _complete uses what passed."""
        peer = partner_snapshot(self.state, self._frozen, received)
        problem = self.distances.problem(self.state, peer)
        if problem is not None:  # non-finite values ban their sender at once; a distance is a strike
            raise (PoisonedPayload if problem.startswith(NON_FINITE) else InvalidPayload)(problem)
        self._screened = (received, peer)

    async def finish(self, peer_id: str, received: dict[str, Tensor] | None, reason: str) -> None:
        # The RPC reporting this is cancelled when its caller vanishes, possibly while the step is
        # being applied: the round's one update must still finish (and set `done`), or outer_step
        # would wait for it forever (seen under CI load in test_partner_dies_mid_exchange).
        await asyncio.shield(self._complete(peer_id, received, reason))

    async def _announce(self, status: str, round_index: int) -> None:
        self._announced_round = round_index
        await self.set_status(status, round_index)

    # ---- the round ------------------------------------------------------------------------
    async def outer_step(self, inner_step: int, round_index: int) -> str:
        """Run one outer round; returns its outcome ('paired' or 'solo')."""
        start = time.monotonic()
        self.catch_up.round_started(start)
        frozen_at = await self._start_round(inner_step, round_index)
        self.matching = True
        await self._announce(Status.MATCHING, round_index)
        tried: set[str] = set()
        await self._find_partner(inner_step, round_index, start + self.match_s, tried)
        if not self.claimed:
            await self._complete(None, None, self._reason)
        await self.done.wait()
        self.matching = False
        outcome, partner = self._outcome
        self.counters.rounds += 1
        self.counters.history.append(
            {
                "round": round_index,
                "outcome": outcome,
                "partner": partner,
                "reason": None if outcome == "paired" else self._reason,
                "proposed_to": len(tried),
                "seconds": time.monotonic() - start,
                "inner_step": inner_step,
                "frozen_at_step": frozen_at,
                "applied_at_step": self._applied_at,
                **self._frozen.stats,
            }
        )
        await self._announce(Status.SERVING, round_index + 1)
        return outcome

    async def _start_round(self, inner_step: int, round_index: int) -> int:
        """Resets the per-round state and freezes this round's snapshot; returns the inner step
        it was frozen at."""
        self.round, self.partner, self.outgoing = round_index, None, None
        self.done = asyncio.Event()
        self.claimed = False
        self._screened: tuple[dict, dict] | None = None
        self._outcome = ("solo", None)
        self._reason = "no partner"
        self._applied_at = inner_step
        poison = self.faults.poison() if self.faults is not None else None
        frozen_at = self.parts.inner_steps()  # past inner_step when the boundaries before it queued up
        self._frozen = await self.compute.run(
            functools.partial(
                freeze,
                self.state,
                self.payload,
                self.codec_phi,
                self.codec_delta,
                dict(self.feedback.residual),
                poison,
                SliceRound(self.run_seed, self.stage, round_index),
            )
        )
        self.distances.saw_drift(self._frozen.stats["drift"])
        return frozen_at

    async def _propose(self, peer: Peer, inner_step: int, deadline: float, tried: set[str]) -> None:
        tried.add(peer.peer_id)
        self.outgoing = peer.peer_id
        proposal = PairProposal(
            peer_id=self.peer_id,
            stage=self.stage,
            round=self.round,
            inner_step=inner_step,
            nonce=os.urandom(8),
            sends_slow_weights=self.payload == PHI_DELTA,
        )
        try:  # the rest of the matching window for an answer; the transfer's deadline follows the link
            received = await self.transport.exchange(
                peer.peer_id,
                proposal,
                self._frozen.snapshot,
                self._frozen.expected,
                self.codec_phi,
                timeout_s=max(0.1, deadline - time.monotonic()),
                screen=self.screen,
            )
        except PeerBusy:
            return
        except InvalidPayload as exc:
            self.partner = peer.peer_id
            log.warning("round %d: snapshot from %s rejected: %s", self.round, peer.peer_id[-8:], exc)
            await self._complete(peer.peer_id, None, "rejected")
            return
        except NodeError as exc:
            self.bans.ban(peer.peer_id)
            self.counters.timed_out += 1
            log.info("round %d: exchange with %s failed: %s", self.round, peer.peer_id[-8:], exc)
            return
        except Exception:  # noqa: BLE001 - a transport surprise costs this partner, never the node
            self.bans.ban(peer.peer_id)
            self.counters.timed_out += 1
            log.exception("round %d: exchange with %s failed unexpectedly", self.round, peer.peer_id[-8:])
            return
        finally:
            self.outgoing = None
        self.partner = peer.peer_id
        await self._complete(peer.peer_id, received, "paired")

    async def _complete(self, peer_id: str | None, received: dict[str, Tensor] | None, reason: str) -> None:
        """Apply exactly one update per round: the pair step with a valid snapshot, else solo."""
        if self.claimed:
            return
        self.claimed = True  # first completion wins; claimed before awaiting so no second one runs
        frozen, screened = self._frozen, self._screened
        if screened is not None and received is not None and screened[0] is received:
            peer, problem = screened[1], None  # judged before the receipts (screen)
        else:
            peer = None if received is None else partner_snapshot(self.state, frozen, received)
            problem = None if peer is None else self.distances.problem(self.state, peer)
        if problem is not None:
            log.warning("round %d: snapshot from %s rejected: %s", self.round, (peer_id or "?")[-8:], problem)
            peer, reason = None, "rejected"
        if reason == "rejected":
            self.counters.rejected += 1
            if peer_id is not None:
                self.bans.ban(peer_id)
        elif reason == "timed_out" and peer_id is not None:
            self.counters.timed_out += 1
        if peer is not None:
            await apply_pair_step(self.compute, self.state, frozen, peer, self.feedback)
            self.counters.paired += 1
            self.catch_up.met(peer_id)
            self._outcome = ("paired", peer_id)
            log.info("round %d: paired with %s", self.round, peer_id[-8:])
        else:
            await self.compute.run(self.state.apply_noloco, [], None, frozen.theta)
            self.counters.solo += 1
            self._outcome, self._reason = ("solo", None), reason
            log.info("round %d: solo step (%s)", self.round, reason)
        self._applied_at = self.parts.inner_steps()
        self.done.set()
