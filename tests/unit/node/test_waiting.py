"""A stage-0 node with no replica of a later stage waits as long as it takes, saying for what,
and goes on the moment one appears (node/joining.py: wait_for_replicas)."""

import asyncio

from noloco_node.node.joining import wait_for_replicas


class Directory:
    """Stage 1 gets its first replica on the 5th fresh lookup."""

    def __init__(self) -> None:
        self.fresh_lookups = 0

    async def replicas(self, stage: int, *, fresh: bool = False) -> list[str]:
        if stage == 0:
            return ["me"]
        self.fresh_lookups += fresh
        return ["them"] if self.fresh_lookups >= 5 else []


def test_waits_saying_for_what_then_goes_on():
    said: list[str | None] = []
    directory = Directory()
    asyncio.run(asyncio.wait_for(wait_for_replicas(directory, range(2), 1, said.append, poll_s=0.001), timeout=10))
    assert said[0] == "a stage-1 replica" and said[-1] is None
    assert directory.fresh_lookups == 5  # the first look is from the cache, every retry fresh


def test_a_present_swarm_costs_one_cached_look():
    said: list[str | None] = []
    directory = Directory()
    directory.fresh_lookups = 5
    asyncio.run(wait_for_replicas(directory, range(2), 1, said.append, poll_s=0.001))
    assert said == [None] and directory.fresh_lookups == 5


def test_stage_0_before_a_batch_looks_only_at_the_later_stages():
    """Its own record may lapse for a moment on a loaded machine: it must not wait for itself."""

    class Lapsed(Directory):
        async def replicas(self, stage: int, *, fresh: bool = False) -> list[str]:
            return [] if stage == 0 else ["them"]

    said: list[str | None] = []
    asyncio.run(asyncio.wait_for(wait_for_replicas(Lapsed(), range(1, 2), 1, said.append, poll_s=0.001), timeout=10))
    assert said == [None]
