"""A stage-0 node with no replica of a later stage waits as long as it takes, saying for what,
and goes on the moment one appears (node/waiting.py: wait_for_replicas)."""

import asyncio
from types import SimpleNamespace

from noloco_node.node.waiting import wait_for_replicas


class Directory:
    """Stage 1 gets its first replica on the 5th fresh lookup."""

    def __init__(self) -> None:
        self.fresh_lookups = 0

    async def replicas(self, stage: int, *, fresh: bool = False) -> list:
        if stage == 0:
            return [SimpleNamespace(peer_id="me")]
        self.fresh_lookups += fresh
        return [SimpleNamespace(peer_id="them")] if self.fresh_lookups >= 5 else []


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
        async def replicas(self, stage: int, *, fresh: bool = False) -> list:
            return [] if stage == 0 else [SimpleNamespace(peer_id="them")]

    said: list[str | None] = []
    asyncio.run(asyncio.wait_for(wait_for_replicas(Lapsed(), range(1, 2), 1, said.append, poll_s=0.001), timeout=10))
    assert said == [None]


def test_a_node_counts_itself_for_its_own_stage_before_its_record_shows():
    """A newcomer saw a resumed stage-0 node say 'waiting for a stage-0 replica' for a moment."""

    class NotYetAnnounced(Directory):
        async def replicas(self, stage: int, *, fresh: bool = False) -> list:
            return [] if stage == 0 else [SimpleNamespace(peer_id="them")]

    said: list[str | None] = []
    waits = wait_for_replicas(NotYetAnnounced(), range(2), 1, said.append, poll_s=0.001, me=(0, "me"))
    asyncio.run(asyncio.wait_for(waits, timeout=10))
    assert said == [None]
    said.clear()
    waits = wait_for_replicas(NotYetAnnounced(), range(2), 2, said.append, poll_s=0.001, me=(0, "me"))
    try:
        asyncio.run(asyncio.wait_for(waits, timeout=0.2))
    except TimeoutError:
        pass
    assert said[0] == "2 replicas of stage 0 (has 1)"  # itself, counted once
