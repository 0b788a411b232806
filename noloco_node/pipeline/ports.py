"""What the pipeline needs from the network, as small Protocols (rpc/ and dht/ implement them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True, slots=True)
class Peer:
    peer_id: str
    address: str
    reach: str = "direct"
    """direct | holepunched | relayed: relayed replicas get a smaller share of the traffic."""
    capacity: float = 0.0
    """Measured sequences per compute-second (0 = unknown): capacity routing weighs by it."""


@dataclass(frozen=True, slots=True)
class MicrobatchKey:
    origin: str
    sequence: int
    attempt: int


@dataclass(frozen=True, slots=True)
class Hop:
    peer_id: str
    address: str
    stage: int


class StageTransport(Protocol):
    async def forward(self, peer: Peer, *, key: MicrobatchKey, route: list[Hop], target_stage: int,
                      activations: Tensor, labels: Tensor) -> None:
        """Deliver activations; raises PeerBusy, PeerUnavailable, InvalidPayload or ProtocolMismatch."""

    async def backward(self, peer_id: str, *, key: MicrobatchKey, target_stage: int, grad: Tensor,
                       loss: float, num_tokens: int) -> None:
        """Deliver the gradient of the receiver's output (the upstream hop `peer_id`), with the loss."""


class ReplicaDirectory(Protocol):
    async def replicas(self, stage: int) -> list[Peer]:
        """Live replicas of `stage` (cached; may include peers that have just died)."""
