"""The ports that pipeline/ and sync/ define (pipeline.ports, sync.noloco), implemented over
rpc/ (gRPC) and dht/ (hivemind). The only place where the two sides meet besides the assembly."""

from __future__ import annotations

from noloco_node.dht.directory import PeerDirectory
from noloco_node.pipeline.ports import MicrobatchKey, Peer
from noloco_node.rpc.stage_service import StageClient
from noloco_node.pipeline.rebalance import Replica
from noloco_node.wire.v1 import stage_pb2


class GrpcStageTransport:
    """pipeline.ports.StageTransport over rpc.StageClient."""

    def __init__(self, client: StageClient) -> None:
        self.client = client

    @staticmethod
    def _id(key: MicrobatchKey) -> stage_pb2.MicrobatchId:
        return stage_pb2.MicrobatchId(origin_peer=key.origin, sequence=key.sequence, attempt=key.attempt)

    async def forward(self, peer: Peer, *, key, route, target_stage, activations, labels) -> None:
        hops = [stage_pb2.Hop(peer_id=h.peer_id, address=h.address, stage=h.stage) for h in route]
        await self.client.forward(peer.peer_id, microbatch=self._id(key), route=hops, target_stage=target_stage,
                                  activations=activations, labels=labels)

    async def backward(self, peer_id, *, key, target_stage, grad, loss, num_tokens) -> None:
        await self.client.backward(peer_id, microbatch=self._id(key), target_stage=target_stage, grad=grad,
                                   loss=loss, num_tokens=num_tokens)


class DhtReplicas:
    """pipeline.ports.ReplicaDirectory over the DHT directory."""

    def __init__(self, directory: PeerDirectory) -> None:
        self.directory = directory

    async def replicas(self, stage: int) -> list[Peer]:
        return [Peer(r.peer_id, r.address, r.reach, r.capacity) for r in await self.directory.replicas(stage)]


class DhtMatching:
    """sync.noloco.MatchingDirectory over the DHT directory (always a fresh lookup)."""

    def __init__(self, directory: PeerDirectory) -> None:
        self.directory = directory

    async def matching(self, stage: int, round_index: int) -> list[Peer]:
        return [Peer(r.peer_id, r.address, r.reach, r.capacity) for r in await self.directory.replicas(stage, fresh=True)
                if r.status == "matching" and r.outer_round == round_index]

    async def replica_count(self, stage: int) -> int:
        """Live replicas of `stage`, ours included (a cached lookup is fine)."""
        return len(await self.directory.replicas(stage))


async def swarm_replicas(directory: PeerDirectory) -> list[Replica]:
    """Every compatible record in the DHT as a rebalancing Replica (pipeline/rebalance.py)."""
    return [Replica(r.peer_id, r.stage, r.capacity, r.throughput, r.status, r.movable, r.moved_at)
            for r in await directory.compatible_records()]
