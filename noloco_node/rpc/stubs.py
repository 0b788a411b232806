"""One gRPC stub per peer, over the channel the dialer holds for it (transport/dialer.py)."""

from __future__ import annotations

import asyncio

from collections.abc import Callable
from typing import Generic, TypeVar

import grpc

Stub = TypeVar("Stub")


class StubCache(Generic[Stub]):
    """`make` builds a service's stub on a channel (e.g. `stage_pb2_grpc.StageStub`). Keyed by
    peer: when the dialer replaced the peer's channel, the peer gets a new stub on the new one."""

    def __init__(self, dialer, make: Callable[[grpc.aio.Channel], Stub]) -> None:
        self.dialer, self.make = dialer, make
        self._stubs: dict[str, tuple[grpc.aio.Channel, Stub]] = {}

    async def get(self, peer_id: str) -> tuple[Stub, str]:
        """The peer's stub and the path its channel takes (direct, holepunched, relayed)."""
        channel, path = await self.dialer.channel(peer_id)
        known = self._stubs.get(peer_id)
        if known is None or known[0] is not channel:
            known = self._stubs[peer_id] = (channel, self.make(channel))
        return known[1], path

    def clear(self) -> None:
        self._stubs.clear()


async def answers_health(dialer, peer_id: str, timeout_s: float) -> bool:
    """Whether `peer_id`'s gRPC health service answers within `timeout_s` where its record says it
    serves (the dialer's channel: TLS pinned to the record, or the libp2p bridge)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from noloco_node.errors import NodeError

    try:
        channel, _ = await dialer.channel(peer_id)
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return True
    except (NodeError, grpc.aio.AioRpcError, asyncio.TimeoutError):
        return False
