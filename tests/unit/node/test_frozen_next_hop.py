"""A stage-1 replica that stops with a whole batch of ours in it (SIGSTOP: nothing fails, nothing
answers) costs stage 0 a health check, not `timeouts.microbatch_s`: a microbatch overdue by
driver.PROBE_AFTER_S asks its next hop's health service, and one that does not answer is
re-issued to the other replica. A soak's frozen replica stopped stage 0 for the whole freeze."""

import asyncio
import logging

from noloco_node.node.in_process import InProcessSwarm
from noloco_node.pipeline.driver import PROBE_AFTER_S

from .conftest import tiny_config


class FreezesAfter:
    """Stage 1's handler that, from its `nth` forward on, takes microbatches and does nothing with
    them, and stops answering (the network's `down`: health checks and new calls fail)."""

    def __init__(self, swarm: InProcessSwarm, peer_id: str, nth: int) -> None:
        self.swarm, self.peer_id, self.nth = swarm, peer_id, nth
        self.handler = swarm.network.handlers[peer_id]
        self.accepted = self.swallowed = 0

    def __getattr__(self, name: str):
        return getattr(self.handler, name)

    async def accept_forward(self, ticket, activations) -> None:
        self.accepted += 1
        if self.accepted < self.nth:
            return await self.handler.accept_forward(ticket, activations)
        self.swallowed += 1
        self.swarm.network.down.add(self.peer_id)
        self.handler.release_forward(ticket)  # not held for the swarm's stop to drain: it never comes back


def test_a_batch_held_by_a_frozen_replica_goes_to_the_other_after_a_health_check(tmp_path, caplog):
    steps = 6
    config = tiny_config(
        tmp_path,
        **{"pipeline.num_stages": 2, "pipeline.batch_size": 8, "timeouts.microbatch_s": 120.0, "timeouts.rpc_s": 5.0},
    )

    async def main() -> tuple[InProcessSwarm, FreezesAfter]:
        swarm = await InProcessSwarm(config, replicas=2).start()
        frozen = FreezesAfter(swarm, "s1r1", nth=3)
        swarm.network.handlers["s1r1"] = frozen
        try:
            await swarm.train(steps, timeout_s=60)
        finally:
            await swarm.stop()
        return swarm, frozen

    with caplog.at_level(logging.INFO, logger="noloco_node.pipeline.driver"):
        swarm, frozen = asyncio.run(main())
    assert "its next hop s1r1 does not answer a health check; re-issuing now" in caplog.text
    assert frozen.swallowed >= 1
    counters = [node.driver.counters for node in swarm.stage(0)]
    assert all(c.dropped == 0 for c in counters), counters
    assert sum(c.reissued for c in counters) >= frozen.swallowed, (counters, frozen.swallowed)
    assert all(node.worker.inner_steps == steps for node in swarm.stage(0))
    assert PROBE_AFTER_S < config.timeouts.microbatch_s
