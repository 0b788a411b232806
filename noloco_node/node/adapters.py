"""The directory ports that pipeline/ and sync/ define (pipeline.ports.ReplicaDirectory,
sync.ports.MatchingDirectory), implemented over the DHT directory (dht/). The gRPC side of the
ports lives in rpc/ itself (rpc/stage_transport.py, rpc/outer_service.py)."""

from __future__ import annotations

import asyncio

from noloco_node.dht.directory import PeerDirectory
from noloco_node.pipeline.ports import Peer
from noloco_node.pipeline.rebalance import Replica
from noloco_node.runtime.node_status import Status


class DhtReplicas:
    """pipeline.ports.ReplicaDirectory over the DHT directory."""

    def __init__(self, directory: PeerDirectory) -> None:
        self.directory = directory

    async def replicas(self, stage: int) -> list[Peer]:
        return [Peer(r.peer_id, r.address, r.reach, r.capacity) for r in await self.directory.replicas(stage)]

    def saw_address(self, peer_id: str, address: str) -> None:
        self.directory.saw_address(peer_id, address)


class DhtMatching:
    """sync.ports.MatchingDirectory and sync.ports.StageProgress over the DHT directory (fresh lookups)."""

    def __init__(self, directory: PeerDirectory) -> None:
        self.directory = directory

    async def matching(self, stage: int, round_index: int) -> list[Peer]:
        return [
            Peer(r.peer_id, r.address, r.reach, r.capacity)
            for r in await self.directory.replicas(stage, fresh=True)
            if r.status == Status.MATCHING and r.outer_round == round_index
        ]

    async def replica_count(self, stage: int) -> int:
        """Live replicas of `stage`, ours included (a cached lookup is fine)."""
        return len(await self.directory.replicas(stage))

    async def inner_steps(self, stage: int, *, timeout_s: float) -> dict[str, int]:
        records = await asyncio.wait_for(self.directory.replicas(stage, fresh=True), timeout_s)
        return {r.peer_id: r.inner_step for r in records}


async def swarm_replicas(directory: PeerDirectory) -> list[Replica]:
    """Every compatible record in the DHT as a rebalancing Replica (pipeline/rebalance.py)."""
    return [
        Replica(r.peer_id, r.stage, r.capacity, r.throughput, r.status, r.movable, r.moved_at, r.move_claimed_at)
        for r in await directory.compatible_records()
    ]
