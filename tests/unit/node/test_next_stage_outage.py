"""The only replica of stage 1 drops out of the directory mid-run (it left, or its record lapsed)
and comes back: stage 0 says so once, holds its microbatches instead of spending their attempts on
nobody, says when stage 1 takes them again, and drops nothing."""

import asyncio
import logging

from noloco_node.node.in_process import InProcessSwarm
from noloco_node.pipeline.outage import NOTICE_S

from .conftest import tiny_config


class HidesOnAccept:
    """Stage 1's handler, which drops its replica out of the directory as it accepts the
    `nth` forward and brings it back `outage_s` later: the microbatches of that batch sent after
    it find nobody (the next batch would wait before it is issued, and never miss)."""

    def __init__(self, swarm: InProcessSwarm, peer_id: str, nth: int, outage_s: float) -> None:
        self.swarm, self.peer_id, self.nth, self.outage_s = swarm, peer_id, nth, outage_s
        self.handler = swarm.network.handlers[peer_id]
        self.accepted = 0
        self.back: asyncio.Task | None = None

    def __getattr__(self, name: str):
        return getattr(self.handler, name)

    async def accept_forward(self, ticket, activations) -> None:
        self.accepted += 1
        if self.accepted == self.nth:
            self.swarm.network.hidden.add(self.peer_id)
            self.back = asyncio.create_task(self._return())
        await self.handler.accept_forward(ticket, activations)

    async def _return(self) -> None:
        await asyncio.sleep(self.outage_s)
        self.swarm.network.hidden.discard(self.peer_id)


async def train_through_an_outage(config, steps: int, outage_s: float) -> InProcessSwarm:
    swarm = await InProcessSwarm(config, replicas=1).start()
    per_batch = config.pipeline.batch_size // config.pipeline.microbatch_size
    hider = HidesOnAccept(swarm, "s1r0", nth=2 * per_batch + 1, outage_s=outage_s)  # batch 3's first
    swarm.network.handlers["s1r0"] = hider
    try:
        await swarm.train(steps, timeout_s=120)
        assert hider.back is not None
        await hider.back
    finally:
        await swarm.stop()
    return swarm


def test_a_stage_that_loses_its_only_next_replica_waits_says_so_once_and_drops_nothing(tmp_path, caplog):
    steps, rpc_s = 6, 0.3
    config = tiny_config(tmp_path, **{"pipeline.num_stages": 2, "timeouts.rpc_s": rpc_s, "pipeline.batch_size": 8})
    with caplog.at_level(logging.DEBUG, logger="noloco_node"):
        swarm = asyncio.run(train_through_an_outage(config, steps, outage_s=10 * rpc_s))
    driver = swarm.stage(0)[0].driver
    c, cfg = driver.counters, config.pipeline
    assert (c.completed, c.dropped) == (steps * cfg.batch_size // cfg.microbatch_size, 0), c
    # Waiting for stage 1 used no attempt beyond the one re-issue per microbatch that missed it.
    assert 1 <= c.reissued <= cfg.batch_size // cfg.microbatch_size and set(driver.log.reissued_sequences), c

    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    warnings = [m for level, m in messages if level >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("no replica of stage 1 took microbatch s0r0#"), warnings
    back = [m for level, m in messages if level == logging.INFO and "takes microbatches again" in m]
    assert len(back) == 1 and f"({c.reissued} sends had found no replica)" in back[0], back
    assert all(s.worker.inner_steps == steps for s in swarm.nodes)


def test_a_send_that_finds_the_stage_empty_says_so_before_its_deadline_and_its_microbatch_lands(tmp_path, caplog):
    """With the default send deadline (30 s) the first word of an empty stage came after half a
    minute of silence: a send that finds nobody listed says so after outage.NOTICE_S, and its
    microbatch still lands when the stage is back within the deadline (nothing missed, nothing
    re-issued)."""
    steps = 4
    config = tiny_config(
        tmp_path,
        **{
            "pipeline.num_stages": 2,
            "pipeline.batch_size": 8,
            "timeouts.rpc_s": 4 * NOTICE_S,
            "timeouts.microbatch_s": 8 * NOTICE_S,
        },
    )
    with caplog.at_level(logging.INFO, logger="noloco_node"):
        swarm = asyncio.run(train_through_an_outage(config, steps, outage_s=NOTICE_S + 1.5))
    c = swarm.stage(0)[0].driver.counters
    assert (c.dropped, c.reissued) == (0, 0), c
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    warnings = [m for level, m in messages if level >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("stage 1 lists no replica: microbatch s0r0#"), warnings
    back = [m for level, m in messages if level == logging.INFO and "takes microbatches again" in m]
    assert len(back) == 1 and back[0].startswith("stage 1 takes microbatches again after") and "sends" not in back[0]


def test_replicas_that_were_listed_and_failed_are_named_not_a_missing_stage(caplog):
    # A soak: a frozen replica's timeout was worded "a node serving stage 1 fixes it", with
    # another replica serving, then "takes microbatches again after 0 s".
    import time

    from noloco_node.pipeline.outage import ReceiverOutage

    outage = ReceiverOutage(1)
    with caplog.at_level(logging.INFO, logger="noloco_node"):
        outage.miss("k", 30.0, started=time.monotonic() - 30.0, failed={"Qm000ekrSVEV5": "DEADLINE_EXCEEDED"})
        outage.took()
    warning, back = [r.getMessage() for r in caplog.records]
    assert "the 1 tried failed (ekrSVEV5: DEADLINE_EXCEEDED)" in warning and "serving stage 1 fixes" not in warning
    assert back.startswith("stage 1 takes microbatches again after 30 s")
