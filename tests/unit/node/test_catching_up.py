"""node/catching_up.py: a replica left rounds behind its stage asks to copy their state, once,
and only when a live replica is a round or more further on."""

import asyncio
from types import SimpleNamespace

from noloco_node.node.catching_up import (
    BEHIND_ROUNDS,
    RECOPY,
    Recopy,
    behind_for,
    copy_again_in_vain,
    watch_behind,
)
from noloco_node.sync.catch_up import AHEAD

AHEAD_SOLO = {"outcome": "solo", "reason": AHEAD}
NO_PARTNER = {"outcome": "solo", "reason": "no partner"}
PAIRED = {"outcome": "paired", "reason": None}
H = 4


def test_behind_for_needs_every_latest_round_solo_with_the_replicas_ahead():
    assert behind_for([PAIRED] + [AHEAD_SOLO] * BEHIND_ROUNDS)
    assert not behind_for([AHEAD_SOLO] * (BEHIND_ROUNDS - 1))  # the catch-up's own skipped rounds
    assert not behind_for([AHEAD_SOLO] * BEHIND_ROUNDS + [PAIRED])
    assert not behind_for([AHEAD_SOLO, NO_PARTNER] + [AHEAD_SOLO] * (BEHIND_ROUNDS - 1))


def test_a_copy_that_left_the_node_behind_is_not_made_again_until_it_pairs():
    recopied = [{"from": 1, "to": 1, "at": 1.0, "inner_step": 8, "why": RECOPY}]
    moved = [{"from": 0, "to": 1, "at": 1.0, "inner_step": 8}]
    behind = [AHEAD_SOLO] * BEHIND_ROUNDS
    assert copy_again_in_vain(behind, recopied)
    assert not copy_again_in_vain([PAIRED] + behind, recopied)
    assert not copy_again_in_vain(behind, moved) and not copy_again_in_vain(behind, [])


class FakeDirectory:
    def __init__(self, steps: dict[str, int]) -> None:
        self.steps, self.lookups = steps, 0

    async def replicas(self, stage: int, fresh: bool = False):
        self.lookups += 1
        return [SimpleNamespace(peer_id=p, inner_step=s) for p, s in self.steps.items()]


class FakeOuterClient:
    def __init__(self, dead: set[str]) -> None:
        self.dead, self.asked = dead, []

    async def answers(self, peer_id: str, timeout_s: float) -> bool:
        self.asked.append(peer_id)
        return peer_id not in self.dead


def fake_node(history: list[dict], steps: dict[str, int], *, moves=(), dead=frozenset()) -> SimpleNamespace:
    events = []
    config = SimpleNamespace(
        outer=SimpleNamespace(inner_steps_per_outer=H), timeouts=SimpleNamespace(heartbeat_s=0.01, rpc_s=5.0)
    )
    return SimpleNamespace(
        config=config,
        sync=SimpleNamespace(counters=SimpleNamespace(history=history)),
        directory=FakeDirectory(steps),
        outer_client=FakeOuterClient(set(dead)),
        peer_id="me",
        stage_index=1,
        worker=SimpleNamespace(inner_steps=steps["me"]),
        moves=list(moves),
        move=None,
        move_requested=asyncio.Event(),
        events=SimpleNamespace(emit=lambda name, **kw: events.append((name, kw))),
        emitted=events,
    )


async def watch_for(node: SimpleNamespace, seconds: float = 0.3) -> None:
    try:
        await asyncio.wait_for(watch_behind(node), seconds)
    except asyncio.TimeoutError:
        pass


async def test_a_node_rounds_behind_asks_to_copy_its_stage_again():
    node = fake_node([PAIRED] + [AHEAD_SOLO] * BEHIND_ROUNDS, {"me": 40, "a": 60, "b": 52})
    await watch_for(node, 5.0)
    assert node.move_requested.is_set()
    assert node.move == Recopy("me", 1, 40, 60) and node.move.source == node.move.target == 1
    assert "20 steps behind" in str(node.move)
    assert node.emitted == [("recopy_planned", {"stage": 1, "inner_step": 40, "replicas_at": 60})]


async def test_no_copy_while_pairing_can_still_bring_it_level_or_nobody_is_a_round_on():
    pairing = fake_node([PAIRED, AHEAD_SOLO, AHEAD_SOLO], {"me": 40, "a": 60})
    near = fake_node([AHEAD_SOLO] * BEHIND_ROUNDS, {"me": 40, "a": 40 + H - 1})
    in_vain = fake_node([AHEAD_SOLO] * BEHIND_ROUNDS, {"me": 40, "a": 60}, moves=[{"from": 1, "to": 1, "why": RECOPY}])
    for node in (pairing, near, in_vain):
        await watch_for(node)
        assert not node.move_requested.is_set() and node.move is None
    assert pairing.directory.lookups == 0 and in_vain.directory.lookups == 0
    assert near.directory.lookups == 1  # once per round seen, not every heartbeat


async def test_no_copy_from_replicas_ahead_that_do_not_answer():
    """A hostile-peer audit: one record at a dead port announcing 3000 steps ahead made a lone
    replica leave its stage, fail the copy and stall ~70 s."""
    fake = fake_node([AHEAD_SOLO] * BEHIND_ROUNDS, {"me": 40, "ghost": 3040}, dead={"ghost"})
    await watch_for(fake)
    assert not fake.move_requested.is_set() and fake.outer_client.asked[:1] == ["ghost"]
    real = fake_node([AHEAD_SOLO] * BEHIND_ROUNDS, {"me": 40, "ghost": 3040, "b": 60}, dead={"ghost"})
    await watch_for(real, 5.0)
    assert real.move_requested.is_set() and real.move.replicas_at == 60  # the one that answers
