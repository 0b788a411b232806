"""What the pipeline needs from the network and offers to it, as small Protocols over plain types
(rpc/ and dht/ implement them over gRPC and the DHT; pipeline/memory.py in memory)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from noloco_node.codec.blockwise import EncodedTensor
from noloco_node.codec.tensors import TensorSpec


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

    def __str__(self) -> str:  # in log lines: origin's short id (as peers are shown), sequence, attempt
        return f"{self.origin[-8:]}#{self.sequence}.{self.attempt}"


@dataclass(frozen=True, slots=True)
class Hop:
    peer_id: str
    address: str
    stage: int


class StageTransport(Protocol):
    bytes_sent: int
    """Payload bytes this node sent to other stages."""

    async def forward(
        self,
        peer: Peer,
        *,
        key: MicrobatchKey,
        route: list[Hop],
        target_stage: int,
        activations: Tensor | EncodedTensor,
        labels: Tensor,
        token_ids: Tensor | None = None,
    ) -> None:
        """Deliver activations (with the input token ids when the model has a residual subspace);
        raises PeerBusy, PeerUnavailable, InvalidPayload or ProtocolMismatch. An EncodedTensor was
        encoded by the stage on its device with this transport's codec and is sent as it is."""

    async def backward(
        self,
        peer_id: str,
        *,
        key: MicrobatchKey,
        target_stage: int,
        grad: Tensor | EncodedTensor,
        loss: float,
        num_tokens: int,
    ) -> None:
        """Deliver the gradient of the receiver's output (the upstream hop `peer_id`), with the loss."""

    async def answers(self, peer_id: str) -> bool:
        """Whether `peer_id` answers a health check within its link's progress deadline: a replica
        that holds our microbatches and stopped (SIGSTOP, swapping) answers nothing."""


class ReplicaDirectory(Protocol):
    async def replicas(self, stage: int) -> list[Peer]:
        """Live replicas of `stage` (cached; may include peers that have just died)."""

    def saw_address(self, peer_id: str, address: str) -> None:
        """A signed caller's own hop says where it serves now: a cached record elsewhere is stale
        (a replica that left and came back under its peer id, at a new port)."""


@dataclass(frozen=True, slots=True)
class ForwardCall:
    """An inbound Forward as the pipeline sees it (the transport has checked the run identity)."""

    key: MicrobatchKey
    target_stage: int
    route: tuple[Hop, ...]
    labels: Sequence[int]
    token_ids: Sequence[int] = ()
    """The input token ids, with a residual subspace (model/subspace.py); empty otherwise."""


@dataclass(frozen=True, slots=True)
class BackwardCall:
    """An inbound Backward: the gradient of the receiver's output for microbatch `key`."""

    key: MicrobatchKey
    target_stage: int
    loss: float
    num_tokens: int


class StageHandler(Protocol):
    """What a transport's server side needs from the pipeline (StageRuntime implements it)."""

    def admit_forward(self, call: ForwardCall, spec: TensorSpec) -> Any:
        """Check shapes against the stage and reserve a window slot; raise NodeError to refuse."""

    def release_forward(self, ticket: Any) -> None:
        """Give back a slot whose payload never arrived intact."""

    async def accept_forward(self, ticket: Any, activations: Tensor) -> None:
        """Take the validated activations; must return quickly (compute happens off the RPC)."""

    def admit_backward(self, call: BackwardCall, spec: TensorSpec, caller: str = "") -> Any:
        """Check the gradient against the saved microbatch (and, when `caller` is known, that it
        comes from the replica the microbatch was forwarded to); raise NodeError to refuse."""

    async def accept_backward(self, ticket: Any, grad: Tensor) -> None:
        """Take the validated gradient; must return quickly."""
