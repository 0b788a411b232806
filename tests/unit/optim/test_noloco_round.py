"""A round's one update survives the cancellation of the RPC that reports it: the servicer's
call is cancelled when a partner vanishes, possibly while the step is being applied."""

import asyncio
import random
import time

import torch
from torch import nn

from noloco_node.optim.state import OuterState
from noloco_node.pipeline.router import Bans
from noloco_node.config import OuterConfig
from noloco_node.sync.noloco import NoLoCoSync
from noloco_node.sync.pairing import NoLoCoSettings
from noloco_node.sync.ports import SyncParts


class SlowCompute:
    """Runs the function in a thread after a delay, like a busy compute thread under load."""

    async def run(self, fn, *args):
        await asyncio.sleep(0.2)
        return await asyncio.to_thread(fn, *args)


class NoPeers:
    async def matching(self, stage, round_index):
        return []


async def _no_status(*_) -> None:
    return None


def lone_sync(config: OuterConfig, transport=None, directory=None, match_s: float = 1.0) -> NoLoCoSync:
    """A replica with one 4-element weight, no peers to match and a slow compute thread."""
    model = nn.Module()
    model.w = nn.Parameter(torch.ones(4))
    state = OuterState(model.named_parameters(), alpha=0.5, beta=0.7)
    parts = SyncParts(compute=SlowCompute(), peer_id="me", stage=0, set_status=_no_status, inner_steps=lambda: 5)
    return NoLoCoSync(
        state,
        config,
        parts,
        transport=transport,
        directory=directory or NoPeers(),
        settings=NoLoCoSettings(match_s=match_s),
        bans=Bans(),
        rng=random.Random(0),
    )


def test_cancelled_finish_still_completes_the_round():
    sync = lone_sync(OuterConfig(codec="none"))

    async def scenario():
        round_task = asyncio.ensure_future(sync.outer_step(inner_step=1, round_index=1))
        await asyncio.sleep(0.3)  # the round is matching (its snapshot frozen)
        sync.partner = "gone"  # an accepted incoming session whose caller then died ...
        finish = asyncio.ensure_future(sync.finish("gone", None, "timed_out"))
        await asyncio.sleep(0.05)
        finish.cancel()  # ... and gRPC cancels its handler while the solo step is applied
        started = time.monotonic()
        outcome = await asyncio.wait_for(round_task, 10)
        return outcome, time.monotonic() - started

    outcome, waited = asyncio.run(scenario())
    assert outcome == "solo" and sync.counters.solo == 1 and sync.counters.rounds == 1
    assert waited < 5


def test_drawn_mates_agree_between_replicas_and_change_between_rounds():
    from noloco_node.sync.pairing import drawn_mate

    ids = ["a", "b", "c", "d"]
    partners = {p: set() for p in ids}
    for round_index in range(1, 21):
        mates = {p: drawn_mate(ids, p, stage=1, round_index=round_index) for p in ids}
        assert all(mates[mates[p]] == p for p in ids)  # symmetric: both sides draw the same pair
        for p in ids:
            partners[p].add(mates[p])
    assert all(len(found) == 3 for found in partners.values())  # over 20 rounds everyone met everyone
    odd = [drawn_mate(ids[:3], p, stage=0, round_index=2) for p in ids[:3]]
    assert odd.count(None) == 1


class SlowLink:
    """A pairing transport whose partner's link gives an accepted exchange a long deadline."""

    def exchange_deadline_s(self, peer_id: str, payload_bytes: int) -> float:
        return 120.0 if peer_id == "far" else 1.0


def test_a_rounds_bound_covers_its_partners_transfer_deadline():
    sync = lone_sync(OuterConfig(codec="none", inner_steps_per_outer=5, overlap=True), transport=SlowLink())

    async def scenario():
        assert sync.round_bound_s() == 0.0  # no round: the caller's own timeout applies
        await sync.at_boundary(5)  # overlapped: returns with the round under way
        await asyncio.sleep(0.3)  # its snapshot frozen, matching
        sync.partner = "far"  # a session we accepted from a replica on a slow link is streaming
        while_streaming = sync.round_bound_s()
        await sync.finish("far", None, "timed_out")
        settled = await sync.settle(while_streaming)
        return while_streaming, settled

    while_streaming, settled = asyncio.run(scenario())
    # More than the fixed 2 x match_s + 10 (timeouts.outer_round_s): the matching windows and the
    # partner's transfer deadline. Stage 0 waits this long for its last round when training ends.
    assert while_streaming >= 3 * 1.0 + 120.0 + 10.0
    assert settled and sync.counters.rounds == 1 and sync.round_bound_s() == 0.0


def test_settle_waits_for_a_round_that_starts_while_it_waits():
    from noloco_node.sync.ports import OuterSync

    class TwoRounds(OuterSync):
        """A later stage: the gradients in flight step it past one more boundary while it stops."""

        def __init__(self) -> None:
            super().__init__()
            self.finished: list[int] = []

        async def at_boundary(self, inner_step: int) -> None:
            self._track(asyncio.ensure_future(self._round(inner_step)))

        async def _round(self, inner_step: int) -> None:
            await asyncio.sleep(0.2)
            self.finished.append(inner_step)
            if inner_step == 5:
                await self.at_boundary(10)  # the next round starts as this one ends

    async def scenario():
        sync = TwoRounds()
        await sync.at_boundary(5)
        settled = await sync.settle(5.0)
        return settled, sync.finished

    settled, finished = asyncio.run(scenario())
    assert settled and finished == [5, 10]


class Fellows(NoPeers):
    """A directory whose fresh lookup lists these live replicas of the stage (none matching)."""

    def __init__(self, *peers: str) -> None:
        self.peers = peers

    async def inner_steps(self, stage, *, timeout_s):
        return {peer: 5 for peer in self.peers}


def test_a_replica_alone_on_its_stage_takes_the_solo_step_without_waiting_out_the_window():
    """Nobody to pair with: a round waited match_s for nobody (every round of a lone replica, e.g.
    the last one left on its stage). A fellow replica that is live but not matching yet still gets
    the window; a lookup that cannot tell (no records at all) too."""

    async def round_of(directory, wait_s: float):
        sync = lone_sync(OuterConfig(codec="none"), directory=directory, match_s=30.0)
        task = asyncio.ensure_future(sync.outer_step(inner_step=5, round_index=1))
        done, _ = await asyncio.wait({task}, timeout=wait_s)
        if not done:
            task.cancel()
            return None
        return task.result(), sync.counters.history[-1]["reason"]

    assert asyncio.run(round_of(Fellows("me"), 20.0)) == ("solo", "no partner")
    assert asyncio.run(round_of(Fellows("me", "fellow"), 3.0)) is None  # still matching after 3 s
    assert asyncio.run(round_of(Fellows(), 3.0)) is None
