"""Two replicas of a stage a round apart find each other again. With no barrier, a replica whose
round went solo early (a lookup missed its fellow) starts its next round while the fellow still
waits out the round before: each then matches a round the other is not in, and without a remedy
every later round of both goes solo (seen in CI: a stage-0 pair, 0 of 6 rounds paired)."""

import asyncio


from noloco_node.pipeline.memory import MemoryNetwork
from noloco_node.sync.memory import MemoryPairingHub
from noloco_node.sync.noloco import NoLoCoSync
from noloco_node.sync.pairing import NoLoCoSettings

from .twins import noloco_replica

MATCH_S = 1.0


def replica(name: str, network: MemoryNetwork, hub: MemoryPairingHub, steps: dict[str, int]) -> NoLoCoSync:
    return noloco_replica(name, network, hub, steps, every=2, settings=NoLoCoSettings(match_s=MATCH_S))


def test_a_replica_still_in_the_round_before_is_waited_for_and_the_pair_meets_again():
    network, hub = MemoryNetwork(), MemoryPairingHub()
    steps = {"a": 2, "b": 4}  # b trained on to its next boundary (overlap) and waits there
    a, b = replica("a", network, hub, steps), replica("b", network, hub, steps)

    async def scenario() -> tuple[list[str], list[str]]:
        first_a = await a.outer_step(inner_step=2, round_index=1)  # b is not matching yet: a goes solo
        steps["a"] = 4

        async def a_next() -> str:
            return await a.outer_step(inner_step=4, round_index=2)

        async def b_late() -> list[str]:
            await asyncio.sleep(0.3 * MATCH_S)  # b reaches round 1 after a has left it
            first_b = await b.outer_step(inner_step=2, round_index=1)
            return [first_b, await b.outer_step(inner_step=4, round_index=2)]

        second_a, b_rounds = await asyncio.wait_for(asyncio.gather(a_next(), b_late()), 20 * MATCH_S)
        return [first_a, second_a], b_rounds

    try:
        a_rounds, b_rounds = asyncio.run(scenario())
    finally:
        a.compute.shutdown()
        b.compute.shutdown()
    assert a_rounds[0] == "solo" and b_rounds[0] == "solo"
    assert a_rounds[1] == "paired" and b_rounds[1] == "paired", (a.counters.history, b.counters.history)
    assert a.counters.history[-1]["partner"] == "b" and b.counters.history[-1]["partner"] == "a"
