"""Ctrl-C on a training stage 0 (its driver cancelled with microbatches in flight) is a stop the
user asked for: the microbatches in flight are counted as dropped and said so in one line, and no
warning follows, neither per microbatch nor for a gradient that arrives after its attempt ended."""

import asyncio
import logging

from noloco_node.node.in_process import InProcessSwarm

from .conftest import tiny_config


async def cancel_once_in_flight(config) -> InProcessSwarm:
    swarm = await InProcessSwarm(config, replicas=1).start()
    try:
        training = asyncio.create_task(swarm.train(10_000, timeout_s=120))
        stage0 = swarm.stage(0)[0]
        async with asyncio.timeout(60):
            while stage0.driver is None or stage0.worker.inner_steps < 2 or not stage0.runtime.in_flight:
                await asyncio.sleep(0.001)
        training.cancel()
        await asyncio.gather(training, return_exceptions=True)
    finally:
        await swarm.stop()
    return swarm


def test_a_stop_with_microbatches_in_flight_drops_them_in_one_line_and_warns_nothing(tmp_path, caplog):
    config = tiny_config(tmp_path, **{"pipeline.num_stages": 2})
    with caplog.at_level(logging.INFO, logger="noloco_node"):
        swarm = asyncio.run(cancel_once_in_flight(config))
    c = swarm.stage(0)[0].driver.counters
    assert c.dropped > 0 and c.issued == c.completed + c.dropped, c
    stopped = [r.getMessage() for r in caplog.records if "training stopped with" in r.getMessage()]
    noun = "microbatch" if c.dropped == 1 else "microbatches"
    assert stopped == [f"training stopped with {c.dropped} {noun} in flight: dropped (the summary counts them)"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [], warnings
