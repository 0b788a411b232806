"""A next hop that loses our microbatches: one that takes them and answers none is shunned after a
timeout (a forward's success does not clear it), and one that stops answering calls gets the
microbatches it holds re-issued at once, not after timeouts.microbatch_s."""

import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from noloco_node.pipeline import driver as driver_module
from noloco_node.pipeline.driver import HopLost, Stage0Driver
from noloco_node.pipeline.ports import Peer
from noloco_node.pipeline.router import LOST_MAX_S, Bans, Router

HOLE = Peer("r-hole", "127.0.0.1:9000", capacity=1e6)  # claims a huge capacity, answers nothing
HONEST = Peer("r-honest", "127.0.0.1:9001", capacity=10.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_replica_that_lost_a_microbatch_gets_none_while_another_is_usable():
    clock = Clock()
    router = Router(Bans(clock=clock), by_capacity=True)
    assert Counter(router.pick([HOLE, HONEST]).peer_id for _ in range(200))["r-hole"] > 150  # the claim wins
    assert router.lost("r-hole", 60.0) == 60.0
    clock.now = 1.0
    assert router.lost("r-hole", 60.0) == 59.0  # another microbatch of the same batch: the same loss
    router.bans.clear("r-hole")  # a forward it acknowledged since: no ban to clear the loss with
    assert {router.pick([HOLE, HONEST]).peer_id for _ in range(100)} == {"r-honest"}
    assert router.pick([HOLE]).peer_id == "r-hole"  # the only one left: still used
    clock.now = 61.0
    assert "r-hole" in {router.pick([HOLE, HONEST]).peer_id for _ in range(100)}
    assert router.lost("r-hole", 60.0) == 120.0  # each loss doubles it
    for _ in range(10):
        clock.now += LOST_MAX_S + 1
        assert router.lost("r-hole", 60.0) <= LOST_MAX_S
    router.returned("r-hole")  # a gradient came back through it
    assert not router.shunned("r-hole")


def _driver(timeout_s: float, runtime) -> Stage0Driver:
    driver = object.__new__(Stage0Driver)  # only the wait for a gradient
    driver.timeout_s, driver.runtime = timeout_s, runtime
    return driver


@pytest.fixture
def quick_checks(monkeypatch):
    monkeypatch.setattr(driver_module, "HOP_CHECK_S", 0.02)


def test_a_microbatch_on_a_hop_that_stopped_answering_is_given_up_at_once(quick_checks):
    runtime = SimpleNamespace(unreachable_at={"r-other": time.monotonic() + 1e6})
    driver = _driver(30.0, runtime)

    async def wait() -> float:
        future = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(driver._gradient(future, "r-gone"))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # another hop's failure is not ours
        runtime.unreachable_at["r-gone"] = time.monotonic()  # a later call to our hop failed
        started = time.monotonic()
        with pytest.raises(HopLost, match="stopped answering"):
            await waiting
        return time.monotonic() - started

    assert asyncio.run(wait()) < 5.0  # within a few checks, not the 30 s timeout


def test_a_failure_before_the_microbatch_was_handed_over_does_not_count(quick_checks):
    runtime = SimpleNamespace(unreachable_at={"r-hop": time.monotonic()})  # failed, then took ours
    driver = _driver(0.3, runtime)

    async def wait():
        future = asyncio.get_running_loop().create_future()
        await driver._gradient(future, "r-hop")

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(wait())


def test_a_gradient_that_comes_back_is_returned(quick_checks):
    driver = _driver(5.0, SimpleNamespace(unreachable_at={}))

    async def wait() -> float:
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, future.set_result, 2.5)
        return await driver._gradient(future, "r-hop")

    assert asyncio.run(wait()) == 2.5
