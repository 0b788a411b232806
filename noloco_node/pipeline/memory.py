"""In-memory twins of the pipeline's ports: a `MemoryNetwork` that holds every node's stage handler
and record in one process, with a StageTransport and a directory over it. Tensors go through the
same wire codec as over gRPC (so the values a stage receives are the wire's), but nothing is
serialised into protobuf, nothing is signed and nothing leaves the event loop: the fast tier
trains whole swarms on it in seconds (node/in_process.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from noloco_node.codec.blockwise import EncodedTensor
from noloco_node.codec.checked import decode_received
from noloco_node.codec.host_memory import receive_buffer
from noloco_node.codec.tensors import encode
from noloco_node.errors import PeerUnavailable, PeerUnknown
from noloco_node.pipeline.ports import BackwardCall, ForwardCall, Hop, MicrobatchKey, Peer, StageHandler
from noloco_node.runtime.node_status import Status


@dataclass(frozen=True)
class MemoryRecord:
    """What a node announces (the DHT record's fields the pipeline and the pairing read)."""

    peer: Peer
    stage: int
    status: str = Status.SERVING
    outer_round: int = 0


class MemoryNetwork:
    def __init__(self, *, codec: str = "none", gradient_codec: str | None = None, pinned_receive: bool = False) -> None:
        self.codec, self.gradient_codec = codec, gradient_codec or codec
        self.pinned_receive = pinned_receive
        """Payloads land in pinned host memory, as a GPU node's Stage servicer receives them."""
        self.handlers: dict[str, StageHandler] = {}
        self.records: dict[str, MemoryRecord] = {}
        self.down: set[str] = set()
        """Peers whose calls fail as if their process had died (tests: fault injection)."""
        self.inner_steps: dict[str, Callable[[], int]] = {}
        self.hidden: set[str] = set()
        """Peers whose records lookups do not return for now, as an expired DHT record (tests)."""

    def register(
        self, peer_id: str, stage: int, handler: StageHandler, inner_steps: Callable[[], int] = lambda: 0
    ) -> None:
        """`inner_steps` reads the node's counter: its record's inner step, always fresh."""
        self.handlers[peer_id] = handler
        self.records[peer_id] = MemoryRecord(Peer(peer_id, f"memory:{peer_id}"), stage)
        self.inner_steps[peer_id] = inner_steps

    def leave(self, peer_id: str) -> None:
        self.handlers.pop(peer_id, None)
        self.records.pop(peer_id, None)
        self.inner_steps.pop(peer_id, None)

    async def set_status(self, peer_id: str, status: str, outer_round: int) -> None:
        record = self.records.get(peer_id)
        if record is not None:
            self.records[peer_id] = replace(record, status=status, outer_round=outer_round)

    def transport(self, me: str) -> MemoryStageTransport:
        return MemoryStageTransport(self, me)

    def directory(self) -> MemoryDirectory:
        return MemoryDirectory(self)

    def handler_of(self, peer_id: str) -> StageHandler:
        if peer_id in self.down:
            raise PeerUnavailable(f"{peer_id} does not answer")
        handler = self.handlers.get(peer_id)
        if handler is None:
            raise PeerUnknown(f"{peer_id} is not in the directory")
        return handler


def through_wire(tensor: Tensor | EncodedTensor, codec: str, *, pinned: bool = False) -> tuple[object, Tensor, int]:
    """(spec, the tensor a receiver decodes, payload bytes) for `tensor` sent with `codec`: float32
    values, handed in as float32 or as the bfloat16 copy a GPU stage makes for a lossy codec,
    which encodes to the same payload (as the gRPC client sends it, rpc/stage_service.py); decoded
    as the Stage servicer decodes it (bf16 stays bf16, codec/checked.py's decode_received), into
    pinned memory where `pinned` (a GPU node's servicer collects payloads there)."""
    if isinstance(tensor, EncodedTensor):  # encoded by the stage on its device
        if tensor.spec.codec != codec:
            raise ValueError(f"the stage encoded {tensor.spec.codec}, this network sends {codec}")
        spec, payload = tensor.spec, tensor.payload_view()
        return spec, _received(spec, payload, pinned), len(payload)
    sent = tensor.detach().cpu()
    if codec in ("none", "topk"):  # these carry the values as they are: float32 on the wire
        sent = sent.to(torch.float32)
    spec, payload = encode(sent, codec, dtype="float32")
    return spec, _received(spec, payload, pinned), len(payload)


def _received(spec, payload, pinned: bool) -> Tensor:
    if pinned:
        buffer, owner = receive_buffer(len(payload), pinned=True)
        if owner is not None:
            buffer[:] = payload
            payload = owner
    return decode_received(spec, payload, pinned=pinned)


class MemoryStageTransport:
    """pipeline.ports.StageTransport between handlers of one MemoryNetwork."""

    def __init__(self, network: MemoryNetwork, me: str) -> None:
        self.network, self.me = network, me
        self.bytes_sent = 0

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
        handler = self.network.handler_of(peer.peer_id)
        spec, tensor, size = through_wire(activations, self.network.codec, pinned=self.network.pinned_receive)
        call = ForwardCall(
            key=key,
            target_stage=target_stage,
            route=tuple(route),
            labels=labels.reshape(-1).tolist(),
            token_ids=() if token_ids is None else token_ids.reshape(-1).tolist(),
        )
        ticket = handler.admit_forward(call, spec)
        self.bytes_sent += size
        await handler.accept_forward(ticket, tensor)

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
        handler = self.network.handler_of(peer_id)
        spec, tensor, size = through_wire(grad, self.network.gradient_codec, pinned=self.network.pinned_receive)
        call = BackwardCall(key=key, target_stage=target_stage, loss=loss, num_tokens=num_tokens)
        ticket = handler.admit_backward(call, spec, self.me)
        self.bytes_sent += size
        await handler.accept_backward(ticket, tensor)

    async def answers(self, peer_id: str) -> bool:
        return peer_id in self.network.handlers and peer_id not in self.network.down


class MemoryDirectory:
    """pipeline.ports.ReplicaDirectory, sync.ports.MatchingDirectory and sync.ports.StageProgress
    over a MemoryNetwork."""

    def __init__(self, network: MemoryNetwork) -> None:
        self.network = network
        self.other_config_peers: dict[str, str] = {}  # one config in a twin's network: always empty

    def _live(self, stage: int) -> list[MemoryRecord]:
        return [
            r
            for r in self.network.records.values()
            if r.stage == stage and r.status != Status.LEAVING and r.peer.peer_id not in self.network.hidden
        ]

    async def replicas(self, stage: int, *, fresh: bool = False) -> list[Peer]:
        return [r.peer for r in self._live(stage)]  # always fresh: no lookup cache here

    def saw_address(self, peer_id: str, address: str) -> None:
        pass  # no lookup cache to correct

    async def matching(self, stage: int, round_index: int) -> list[Peer]:
        return [r.peer for r in self._live(stage) if r.status == Status.MATCHING and r.outer_round == round_index]

    async def replica_count(self, stage: int) -> int:
        return len(self._live(stage))

    async def inner_steps(self, stage: int, *, timeout_s: float) -> dict[str, int]:
        return {r.peer.peer_id: self.network.inner_steps[r.peer.peer_id]() for r in self._live(stage)}
