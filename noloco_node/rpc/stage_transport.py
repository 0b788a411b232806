"""pipeline.ports.StageTransport over gRPC: the pipeline's plain microbatch keys and hops become
the Stage service's messages here, so nothing above rpc/ sees protobuf."""

from __future__ import annotations

from torch import Tensor

from noloco_node.pipeline.ports import Hop, MicrobatchKey, Peer
from noloco_node.rpc.stage_service import StageClient
from noloco_node.wire.v1 import stage_pb2


def _microbatch(key: MicrobatchKey) -> stage_pb2.MicrobatchId:
    return stage_pb2.MicrobatchId(origin_peer=key.origin, sequence=key.sequence, attempt=key.attempt)


class GrpcStageTransport:
    def __init__(self, client: StageClient) -> None:
        self.client = client

    @property
    def bytes_sent(self) -> int:
        return self.client.bytes_sent

    async def forward(
        self,
        peer: Peer,
        *,
        key: MicrobatchKey,
        route: list[Hop],
        target_stage: int,
        activations: Tensor,
        labels: Tensor,
        token_ids: Tensor | None = None,
    ) -> None:
        hops = [stage_pb2.Hop(peer_id=h.peer_id, address=h.address, stage=h.stage) for h in route]
        await self.client.forward(
            peer.peer_id,
            microbatch=_microbatch(key),
            route=hops,
            target_stage=target_stage,
            activations=activations,
            labels=labels,
            token_ids=token_ids,
        )

    async def backward(
        self, peer_id: str, *, key: MicrobatchKey, target_stage: int, grad: Tensor, loss: float, num_tokens: int
    ) -> None:
        await self.client.backward(
            peer_id, microbatch=_microbatch(key), target_stage=target_stage, grad=grad, loss=loss, num_tokens=num_tokens
        )

    async def answers(self, peer_id: str) -> bool:
        return await self.client.answers(peer_id)
