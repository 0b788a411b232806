"""Unsigned, long-lived Health.Watch streams are capped: a hostile-peer audit held 64 open and every
peer's calls were refused (the server's concurrent-call cap) until it let go."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from noloco_node.rpc.server import MAX_HEALTH_WATCHES, _StrictHealth


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.written: list = []
        self.code = None

    async def write(self, message) -> None:
        self.written.append(message.status)

    async def abort(self, code, details: str):
        self.code, self.details = code, details
        raise Aborted(details)


async def test_more_watches_than_the_cap_are_refused_and_a_closed_one_frees_its_place():
    health = _StrictHealth()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    request = health_pb2.HealthCheckRequest(service="")
    watchers = [asyncio.create_task(health.Watch(request, Context())) for _ in range(MAX_HEALTH_WATCHES)]
    await asyncio.sleep(0.05)
    assert health.watching == MAX_HEALTH_WATCHES and not any(w.done() for w in watchers)
    refused = Context()
    with pytest.raises(Aborted):
        await health.Watch(request, refused)
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "ask Check instead" in refused.details
    checked = await health.Check(request, Context())
    assert checked.status == health_pb2.HealthCheckResponse.SERVING

    watchers[0].cancel()  # the caller hung up
    await asyncio.gather(watchers[0], return_exceptions=True)
    assert health.watching == MAX_HEALTH_WATCHES - 1
    again = Context()
    watchers[0] = asyncio.create_task(health.Watch(request, again))
    await asyncio.sleep(0.05)
    assert again.code is None and again.written == [health_pb2.HealthCheckResponse.SERVING]
    for w in watchers:
        w.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)
    assert health.watching == 0
