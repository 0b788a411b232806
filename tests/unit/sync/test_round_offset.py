"""Two replicas of a stage a round apart find each other again. With no barrier, a replica whose
round went solo early (a lookup missed its fellow) starts its next round while the fellow still
waits out the round before: each then matches a round the other is not in, and without a remedy
every later round of both goes solo (seen in CI: a stage-0 pair, 0 of 6 rounds paired)."""

import asyncio

import torch
from torch import nn

from noloco_node.config import OuterConfig
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.memory import MemoryNetwork
from noloco_node.pipeline.router import Bans
from noloco_node.runtime.compute import ComputeThread
from noloco_node.sync.memory import MemoryPairingHub
from noloco_node.sync.noloco import NoLoCoSync
from noloco_node.sync.pairing import NoLoCoSettings
from noloco_node.sync.ports import SyncParts

MATCH_S = 1.0


def replica(name: str, network: MemoryNetwork, hub: MemoryPairingHub, steps: dict[str, int]) -> NoLoCoSync:
    model = nn.Module()
    model.w = nn.Parameter(torch.ones(4))
    network.register(name, 0, None, inner_steps=lambda: steps[name])

    async def set_status(status: str, round_index: int) -> None:
        await network.set_status(name, status, round_index)

    parts = SyncParts(
        compute=ComputeThread(), peer_id=name, stage=0, set_status=set_status, inner_steps=lambda: steps[name]
    )
    sync = NoLoCoSync(
        OuterState(model.named_parameters(), alpha=0.5, beta=0.7),
        OuterConfig(codec="none", inner_steps_per_outer=2),
        parts,
        transport=hub.transport(name),
        directory=network.directory(),
        settings=NoLoCoSettings(match_s=MATCH_S),
        bans=Bans(),
    )
    hub.register(name, sync)
    return sync


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
