"""Two replicas of a stage that started rounds apart get back in step (sync/catch_up.py). Without
it, each matched rounds the other was not in and every round of both went solo (seen in CI: every
round of one of two home nodes behind NAT): here the same start skew with catch-up off
pairs no round at all, and with it on pairs every round after the first two."""

import asyncio

import pytest

from noloco_node.pipeline.memory import MemoryNetwork
from noloco_node.pipeline.ports import Peer
from noloco_node.sync.catch_up import CatchUp, RoundView, nobody_to_wait_for
from noloco_node.sync.memory import MemoryPairingHub
from noloco_node.sync.noloco import NoLoCoSync
from noloco_node.sync.pairing import NoLoCoSettings

from .twins import noloco_replica

MATCH_S, STEP_S, EVERY, ROUNDS = 0.4, 0.25, 4, 6
SKEW_STEPS = 7  # 1.75 rounds: more than a round, and longer in time than the old two windows (0.8 s)


def replica(name: str, network: MemoryNetwork, hub: MemoryPairingHub, steps: dict, catch_up_rounds: int) -> NoLoCoSync:
    settings = NoLoCoSettings(match_s=MATCH_S, heartbeat_s=0.1, catch_up_rounds=catch_up_rounds)
    return noloco_replica(name, network, hub, steps, every=EVERY, settings=settings)


def run_skewed(delays: dict[str, float], catch_up_rounds: int, rounds: int = ROUNDS) -> dict[str, list[str]]:
    """Replicas that start training after their delays; each takes one step every STEP_S.
    Returns each one's round outcomes, a solo round's reason after a colon."""
    network, hub = MemoryNetwork(), MemoryPairingHub()
    steps = {name: 0 for name in delays}
    syncs = {name: replica(name, network, hub, steps, catch_up_rounds) for name in delays}

    async def train(name: str) -> None:
        await asyncio.sleep(delays[name])
        for step in range(1, EVERY * rounds + 1):
            await asyncio.sleep(STEP_S)
            steps[name] = step
            await syncs[name].at_boundary(step)
        assert await syncs[name].settle(30.0)

    async def all_of_them() -> None:
        await asyncio.wait_for(asyncio.gather(*(train(name) for name in delays)), 120)

    try:
        asyncio.run(all_of_them())
    finally:
        for sync in syncs.values():
            sync.compute.shutdown()
    return {
        name: [h["outcome"] + (f":{h['reason']}" if h["reason"] else "") for h in sync.counters.history]
        for name, sync in syncs.items()
    }


def run_skewed_pair(catch_up_rounds: int) -> tuple[list[str], list[str]]:
    """a starts training SKEW_STEPS steps before b."""
    outcomes = run_skewed({"a": 0.0, "b": SKEW_STEPS * STEP_S}, catch_up_rounds)
    return [o.split(":")[0] for o in outcomes["a"]], outcomes["b"]


def test_replicas_rounds_apart_never_pair_without_catching_up():
    a, b = run_skewed_pair(catch_up_rounds=0)
    # b, behind, sees a past each of its rounds but the last (a ends there): it steps solo at once,
    # and says why (a node that stays behind is told to rejoin: node/attention.py).
    assert a.count("paired") == 0 and b[:-1] == ["solo:replicas ahead"] * (ROUNDS - 1), (a, b)


def test_the_replica_ahead_waits_and_the_one_behind_skips_until_they_pair_every_round():
    a, b = run_skewed_pair(catch_up_rounds=2)
    b = [o.split(":")[0] for o in b]
    assert len(a) == len(b) == ROUNDS
    # a's first round waits one window only (no round period yet): b, not there in time, is
    # skipped in round 2 as a drawn mate that never came, and b skips the rounds a already left;
    # from round 3 on they meet in every round (measured: rounds 3-6 paired, with and without load).
    assert a[2:] == ["paired"] * (ROUNDS - 2) and b[2:] == ["paired"] * (ROUNDS - 2), (a, b)


def test_a_replica_behind_a_pair_in_step_is_drawn_too_and_stops_being_the_odd_one_out():
    delays = {"a": 0.0, "b": 0.0, "c": SKEW_STEPS * STEP_S}
    without = run_skewed(delays, catch_up_rounds=0, rounds=8)
    assert not any(o == "paired" for o in without["c"]), without  # a and b meet every round, c never
    outcomes = run_skewed(delays, catch_up_rounds=2, rounds=8)
    pairs = sum(o.count("paired") for o in outcomes.values()) / 2
    # Measured: c paired in 5 of 8 rounds, 7 pairs in 8 rounds (at most one pair per round of three).
    assert outcomes["c"].count("paired") >= 2 and pairs >= 5, outcomes


class Directory:
    """A stage's records as a fixed lookup: inner steps, and who matches which round."""

    def __init__(self, steps: dict[str, int], matching: dict[int, list[str]] | None = None) -> None:
        self.steps, self.by_round = steps, matching or {}

    async def matching(self, stage: int, round_index: int) -> list[Peer]:
        return [Peer(p, f"memory:{p}") for p in self.by_round.get(round_index, [])]

    async def inner_steps(self, stage: int, *, timeout_s: float) -> dict[str, int]:
        return dict(self.steps)


def nobody(directory: Directory, inner_step: int = 8, round_index: int = 2, banned=lambda p: False) -> str | None:
    return asyncio.run(
        nobody_to_wait_for(RoundView(directory, 0, "me", inner_step, 4, round_index, banned, timeout_s=1))
    )


@pytest.mark.parametrize(
    "steps, matching, expected",
    [
        ({"me": 8}, {}, "alone"),  # alone in the stage
        ({"me": 8, "x": 12}, {3: ["x"]}, "replicas ahead"),  # x waits a round ahead
        ({"me": 8, "x": 12}, {2: ["x"]}, None),  # x trained on to its next boundary, still in this round
        ({"me": 8, "x": 10}, {}, None),  # x is in this round (training on while it matches)
        ({"me": 8, "x": 5}, {}, None),  # x is behind: this round may still meet it
        ({"x": 12}, {}, None),  # our own record is missing: the lookup cannot tell
        ({}, {}, None),
    ],
)
def test_nobody_to_wait_for(steps, matching, expected):
    assert nobody(Directory(steps, matching)) == expected


def test_a_banned_replica_behind_is_not_waited_for():
    assert nobody(Directory({"me": 8, "x": 5}), banned=lambda p: p == "x") == "alone"


def test_a_replica_counts_as_on_its_way_while_it_moves_and_within_the_rounds_behind():
    catch_up = CatchUp(match_s=0.05, heartbeat_s=0.01, rounds=2)
    steps = {"me": 16, "x": 9, "y": 17}
    directory = Directory(steps)

    def laggards() -> list[str]:
        return asyncio.run(catch_up.laggards(RoundView(directory, 0, "me", 16, 4, 4, lambda p: False, timeout_s=1)))

    assert laggards() == ["x"]  # 1.75 rounds behind, just seen; y is ahead
    asyncio.run(asyncio.sleep(0.1))
    assert laggards() == []  # stood still past the stall time
    steps["x"] = 10
    assert laggards() == ["x"]  # moved again
    steps["x"] = 7
    assert laggards() == []  # more than 2 rounds behind
    directory.by_round = {3: ["x"]}
    assert laggards() == ["x"]  # matching the round before ours
    catch_up.stop()
    assert laggards() == []  # a stopping node waits for nobody


def test_the_wait_past_the_first_window_follows_the_round_period():
    catch_up = CatchUp(match_s=5.0, heartbeat_s=10.0, rounds=2)
    assert catch_up.extra_s() == 5.0  # no period yet: one more window
    catch_up.round_started(100.0)
    catch_up.round_started(160.0)
    assert catch_up.extra_s() == 120.0  # two rounds of 60 s
    assert CatchUp(match_s=5.0, heartbeat_s=10.0, rounds=0).extra_s() == 0.0


def test_a_stopping_node_stops_waiting_for_a_replica_behind_it():
    network, hub = MemoryNetwork(), MemoryPairingHub()
    steps = {"a": 8, "b": 5}
    a = replica("a", network, hub, steps, catch_up_rounds=2)
    network.register("b", 0, None, inner_steps=lambda: steps["b"])
    a.catch_up.period_s = 60.0  # rounds of a minute here: it would wait up to two of them for b

    async def scenario() -> tuple[bool, str, float]:
        async def b_creeps() -> None:  # b moves, but far slower than a minute per round
            while True:
                await asyncio.sleep(0.1)
                steps["b"] = min(steps["b"] + 1, 7) if steps["b"] < 7 else 6

        creeping = asyncio.ensure_future(b_creeps())
        round_ = asyncio.ensure_future(a.outer_step(inner_step=8, round_index=2))
        await asyncio.sleep(3 * MATCH_S)
        still_waiting = not round_.done()
        loop = asyncio.get_running_loop()
        asked = loop.time()
        a.wind_down()
        outcome = await asyncio.wait_for(round_, 30)
        creeping.cancel()
        return still_waiting, outcome, loop.time() - asked

    try:
        still_waiting, outcome, took_s = asyncio.run(scenario())
    finally:
        a.compute.shutdown()
    assert still_waiting and outcome == "solo"
    assert took_s < 3 * MATCH_S + 2.0, took_s  # the window under way, not the two minutes


def test_a_drawn_mate_that_never_came_is_skipped_for_rounds_doubling_until_it_pairs():
    """A peer whose record claims progress it never makes (a liar, or a replica too far behind)
    would otherwise be drawn and waited for round after round."""
    catch_up = CatchUp(match_s=0.05, heartbeat_s=0.01, rounds=2)
    directory = Directory({"me": 16, "x": 15})

    def counted(round_index: int) -> bool:
        view = RoundView(directory, 0, "me", 16, 4, round_index, lambda p: False, timeout_s=1)
        directory.steps["x"] = 31 - directory.steps["x"]  # 15 <-> 16: it keeps announcing progress
        return asyncio.run(catch_up.laggards(view)) == ["x"]

    assert counted(4)
    catch_up.missed("x", 4)
    assert [counted(r) for r in (5, 6)] == [False, True]  # one round skipped
    catch_up.missed("x", 6)
    assert [counted(r) for r in (7, 8, 9)] == [False, False, True]  # then two
    catch_up.met("x")
    assert counted(10)  # paired at last: forgiven
