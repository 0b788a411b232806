"""What a node is built around before it exists: the status board the outer sync announces
through, the RPC timings, and the cleanup of a build that fails halfway."""

import asyncio

import pytest

from noloco_node.node.building import RpcTimings, StatusBoard, _Opened
from noloco_node.runtime.node_status import Status
from noloco_node.runtime.throughput import ThroughputMeter


def test_the_board_announces_what_the_sync_sets_and_not_what_the_node_sets_itself():
    board = StatusBoard()
    published: list[Status] = []

    async def publish():
        published.append(board.status)

    async def scenario():
        await board.set("matching", 3)  # before the node says how to publish: only kept
        board.publish_with(publish)
        await board.set("matching", 4)
        board.become(Status.LEAVING)
        await board.set(Status.SERVING, 4)

    asyncio.run(scenario())
    assert published == [Status.MATCHING, Status.SERVING]
    assert board.status == Status.SERVING and board.status == "serving"


def test_rpc_timings_feed_the_meter_with_forwards_and_every_sink_with_every_call():
    meter = ThroughputMeter()
    timings = RpcTimings(meter)
    seen: list[tuple[str, float]] = []
    timings.observe("Forward", 0.5)  # before /metrics opens: the meter only
    timings.sinks.append(lambda method, seconds: seen.append((method, seconds)))
    timings.observe("Backward", 0.25)
    timings.observe("Forward", 0.75)
    assert seen == [("Backward", 0.25), ("Forward", 0.75)]
    assert 0.5 <= meter.record_fields()["hop_s"] <= 0.75  # the Backward (0.25 s) is not a hop


def test_a_failed_build_closes_what_it_opened_in_reverse_even_when_a_close_fails():
    closed: list[str] = []
    opened = _Opened()

    async def close_dht():
        closed.append("dht")

    def close_compute():
        closed.append("compute")

    async def close_server():
        closed.append("server")
        raise RuntimeError("already stopped")

    opened.add("dht", close_dht)
    opened.add("compute", close_compute)
    opened.add("server", close_server)
    asyncio.run(opened.close())
    assert closed == ["server", "compute", "dht"]


def test_status_board_refuses_a_status_no_record_may_carry():
    with pytest.raises(ValueError):
        asyncio.run(StatusBoard().set("sleeping", 0))
