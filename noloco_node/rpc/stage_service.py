"""Stage.Forward / Stage.Backward servers and client.

The servicer validates in this order, before it allocates or computes: run identity
(FAILED_PRECONDITION), tensor header (INVALID_ARGUMENT), the handler's shape and admission
checks (INVALID_ARGUMENT / RESOURCE_EXHAUSTED / FAILED_PRECONDITION), then the payload: chunk order, exact
length, decodability, and values: finite and within the stage's running bounds (INVALID_ARGUMENT,
and the sender is banned at once; see optim/integrity.py). A rejected call never disturbs the
node: the handler releases what it reserved and the next request is served as usual.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import torch
from torch import Tensor

from noloco_node.codec.blockwise import EncodedTensor
from noloco_node.codec.checked import decode_received
from noloco_node.codec.tensors import TensorSpec
from noloco_node.errors import InvalidPayload, NodeError, PoisonedPayload, TooLarge
from noloco_node.optim.integrity import RunningBounds
from noloco_node.pipeline.ports import BackwardCall, ForwardCall, Hop, MicrobatchKey, StageHandler
from noloco_node.rpc.admission import CALLER, POISONED
from noloco_node.rpc.checks import ServedRun, check_caller
from noloco_node.rpc.deadlines import BUFFERED_BYTES, Progress, paced, while_sending
from noloco_node.rpc.status import abort_with, error_from_rpc, status_of
from noloco_node.rpc.stubs import StubCache, answers_health
from noloco_node.rpc.tensors import PayloadReceiver, chunk_messages, encode_tensor, header_to_spec, spec_to_header
from noloco_node.runtime.link_estimates import RECEIVED, SENT, LinkDeadlines
from noloco_node.wire.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)

# Transport limit per message. Headers are capped far lower by the servicer itself, after the
# message is in: a message over gRPC's own limit resets the stream mid-write, and the sender then
# sees INTERNAL or RESOURCE_EXHAUSTED depending on timing.
MAX_HEADER_BYTES = 1 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Servers accept the clients' 30 s keepalive pings (the default minimum is 5 min, answered
    # with GOAWAY "too_many_pings").
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    # A client channel whose path failed tries again within 5 s at most (gRPC's default backs off
    # to 120 s): after a relay's restart, calls over a cached channel failed at once for a minute.
    ("grpc.initial_reconnect_backoff_ms", 1000),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


def forward_call(header: stage_pb2.ForwardHeader) -> ForwardCall:
    """The pipeline's view of a Forward header (pipeline/ports.py): plain values, no protobuf."""
    m = header.microbatch
    return ForwardCall(
        key=MicrobatchKey(m.origin_peer, m.sequence, m.attempt),
        target_stage=header.target_stage,
        route=tuple(Hop(h.peer_id, h.address, h.stage) for h in header.route),
        labels=header.labels,
        token_ids=header.token_ids,
    )


def backward_call(header: stage_pb2.BackwardHeader) -> BackwardCall:
    m = header.microbatch
    return BackwardCall(
        key=MicrobatchKey(m.origin_peer, m.sequence, m.attempt),
        target_stage=header.target_stage,
        loss=float(header.loss),
        num_tokens=int(header.num_tokens),
    )


async def _receive(
    messages: AsyncIterator, spec: TensorSpec, max_bytes: int, stall_s: float, pinned: bool
) -> tuple[Tensor, int]:
    """The payload after the header, into pinned memory where asked; a stream that sends no message
    for `stall_s` raises TimeoutError."""
    receiver = PayloadReceiver(spec, max_bytes=max_bytes, pinned=pinned)
    while True:
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns a message that arrived as the caller's
            # total deadline cancelled it, and that deadline is lost while chunks keep coming.
            async with asyncio.timeout(stall_s):
                message = await messages.__anext__()
        except StopAsyncIteration:
            break
        if message is None:
            raise InvalidPayload("undecodable message in the stream")
        if message.WhichOneof("kind") != "chunk":
            raise InvalidPayload("a second header arrived inside a stream; expected payload chunks")
        receiver.add(message.chunk)
    payload = receiver.finish()
    return decode_received(spec, payload, pinned=pinned), len(payload)


@dataclass(frozen=True)
class ValueScreen:
    """What a received tensor's values must keep to (optim/integrity.py's RunningBounds): an RMS
    within `rms_factor` of the recent ones' median, no element beyond `max_abs`."""

    rms_factor: float = 1000.0
    max_abs: float = 1e6

    def bounds(self) -> RunningBounds:
        return RunningBounds(factor=self.rms_factor, max_abs=self.max_abs)


class StageServicer(stage_pb2_grpc.StageServicer):
    """`run` names the run served (its stage left to the handler, which checks each call's target
    stage). `receive_s` bounds how long a caller may take to send its header; its payload must then
    arrive within `receive_s` plus its size at `min_bytes_per_s`, or at the caller's measured
    bandwidth (`deadlines`, runtime/link_estimates.py) times the slack where that is slower, and
    no chunk may take longer than the progress deadline: a stream that stalls is cut with
    DEADLINE_EXCEEDED and its in-flight slot freed, whatever deadline (or none) the client set.
    Each direction's values are screened against its own recent traffic (`screen`).
    `pinned_receive` (a stage on a GPU): payloads land in pinned host memory (codec/host_memory.py)."""

    def __init__(
        self,
        handler: StageHandler,
        *,
        run: ServedRun,
        max_payload_bytes: int,
        receive_s: float = 10.0,
        min_bytes_per_s: float = 1e6,
        screen: ValueScreen = ValueScreen(),
        deadlines: LinkDeadlines | None = None,
        pinned_receive: bool = False,
    ) -> None:
        self.handler = handler
        self.pinned_receive = pinned_receive
        self.run = run
        self.max_payload_bytes = max_payload_bytes
        self.receive_s, self.min_bytes_per_s = receive_s, min_bytes_per_s
        self.deadlines = deadlines or LinkDeadlines()
        self.rejected: dict[str, int] = {}
        self.bytes_received = 0
        self.cut_at_deadline = 0
        self.bounds = {kind: screen.bounds() for kind in ("forward", "backward")}

    def _check_values(self, kind: str, tensor: Tensor) -> None:
        why = self.bounds[kind].check(tensor)
        if why is not None:
            raise PoisonedPayload(why)

    async def _first(self, messages: AsyncIterator, kind: str):
        try:
            first = await messages.__anext__()
        except StopAsyncIteration:
            raise InvalidPayload("empty stream: expected a header first") from None
        if first is None:
            raise InvalidPayload("undecodable first message: expected a header")
        if first.ByteSize() > MAX_HEADER_BYTES:
            raise TooLarge(f"header of {first.ByteSize()} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
        if first.WhichOneof("kind") != "header":
            raise InvalidPayload(f"stream starts with {first.WhichOneof('kind')!r}; expected a {kind} header")
        return first.header

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, error: NodeError) -> None:
        code = status_of(error)
        self.rejected[code.name] = self.rejected.get(code.name, 0) + 1
        if isinstance(error, PoisonedPayload):
            self.rejected["poisoned"] = self.rejected.get("poisoned", 0) + 1
            POISONED.set(True)
            log.warning("%s refused: %s", method, error)
        log.debug("%s rejected with %s: %s", method, code.name, error)
        await abort_with(context, error)

    def _payload_deadline(self, started: float, spec: TensorSpec, caller: str) -> float:
        link_s = self.deadlines.transfer_s(caller, spec.payload_bytes, RECEIVED)
        return started + self.receive_s + max(spec.payload_bytes / self.min_bytes_per_s, link_s)

    async def _payload(self, messages: AsyncIterator, started: float, spec: TensorSpec) -> tuple[Tensor, int]:
        """The payload within its deadlines; a bandwidth sample of the caller's link when it arrived."""
        caller = CALLER.get()
        began = asyncio.get_running_loop().time()
        async with asyncio.timeout_at(self._payload_deadline(started, spec, caller)):
            tensor, size = await _receive(
                messages, spec, self.max_payload_bytes, self.deadlines.stall_s(caller, RECEIVED), self.pinned_receive
            )
        if caller:
            self.deadlines.estimates.observe(caller, size, asyncio.get_running_loop().time() - began, RECEIVED)
        return tensor, size

    async def _cut(self, context, method: str, waited_s: float) -> None:
        self.cut_at_deadline += 1
        self.rejected["DEADLINE_EXCEEDED"] = self.rejected.get("DEADLINE_EXCEEDED", 0) + 1
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{method} stream incomplete after {waited_s:.1f} s (this node's receive deadline)",
        )

    async def Forward(self, request_iterator, context):
        ticket = None
        started = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout_at(started + self.receive_s):
                header = await self._first(request_iterator, "forward")
            self.run.check(header.run)
            check_caller(header.route[-1].peer_id if header.route else "", "the route's last hop")
            spec = header_to_spec(header.activations)
            ticket = self.handler.admit_forward(forward_call(header), spec)
            tensor, size = await self._payload(request_iterator, started, spec)
            self._check_values("forward", tensor)
            accepted, ticket = ticket, None
            self.bytes_received += size
            await self.handler.accept_forward(accepted, tensor)
            return stage_pb2.StageAck(bytes_received=size)
        except NodeError as error:
            if ticket is not None:
                self.handler.release_forward(ticket)
            await self._abort(context, "Forward", error)
        except TimeoutError:
            if ticket is not None:
                self.handler.release_forward(ticket)
            await self._cut(context, "Forward", asyncio.get_running_loop().time() - started)
        except BaseException:
            if ticket is not None:
                self.handler.release_forward(ticket)
            raise

    async def Backward(self, request_iterator, context):
        started = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout_at(started + self.receive_s):
                header = await self._first(request_iterator, "backward")
            self.run.check(header.run)
            spec = header_to_spec(header.grad)
            ticket = self.handler.admit_backward(backward_call(header), spec, CALLER.get())
            tensor, size = await self._payload(request_iterator, started, spec)
            self._check_values("backward", tensor)
            self.bytes_received += size
            await self.handler.accept_backward(ticket, tensor)
            return stage_pb2.StageAck(bytes_received=size)
        except NodeError as error:
            await self._abort(context, "Backward", error)
        except TimeoutError:
            await self._cut(context, "Backward", asyncio.get_running_loop().time() - started)


@dataclass(frozen=True)
class StageCodecs:
    """How a StageClient encodes what it sends (codec/tensors.py)."""

    activations: str
    """Forward's activations (pipeline.activation_codec)."""
    gradients: str | None = None
    """Backward's gradients (pipeline.gradient_codec); None: the activations' codec."""
    rounding_seed: int | None = None
    """Seeds the stochastic rounding of gradients (None: a fresh random seed)."""


class StageClient:
    """Sends activations and gradients to other nodes, by peer id, through the dialer
    (transport/dialer.py: direct TLS or gRPC over libp2p, whichever the peer's record says).

    `codecs` encode the activations of Forward and the gradients of Backward. Gradients round
    stochastically where the codec can (int4, see codec/tensors.py), with draws from a generator
    seeded by `codecs.rounding_seed` (None = a fresh random seed).

    A call's deadline is `timeout_s` (timeouts.rpc_s) or its payload's time at the peer's measured
    bandwidth times the slack, whichever is longer (`deadlines`, runtime/link_estimates.py; None: a
    fresh estimator with the default policy); a call that gets no message out for the progress
    deadline is cut. Every call is a sample of that peer's link."""

    def __init__(
        self,
        *,
        run_id: str,
        manifest_hash: str,
        codecs: StageCodecs,
        timeout_s: float,
        dialer,
        observe: Callable[[str, float], None] | None = None,
        deadlines: LinkDeadlines | None = None,
    ) -> None:
        self.run = tensor_pb2.RunIdentity(run_id=run_id, manifest_hash=manifest_hash)
        self.dialer = dialer
        self.codec, self.timeout_s = codecs.activations, timeout_s
        self.deadlines = (deadlines or LinkDeadlines()).floored(timeout_s)
        self.gradient_codec = codecs.gradients or codecs.activations
        self.rounding = torch.Generator()
        if codecs.rounding_seed is None:
            self.rounding.seed()
        else:
            self.rounding.manual_seed(codecs.rounding_seed)
        self.observe = observe  # (method, seconds) after every call, for latency metrics
        self._stubs = StubCache(dialer, stage_pb2_grpc.StageStub)
        self.bytes_sent = 0

    async def forward(
        self,
        peer_id: str,
        *,
        microbatch: stage_pb2.MicrobatchId,
        route: list[stage_pb2.Hop],
        target_stage: int,
        activations: Tensor | EncodedTensor,
        labels: Tensor,
        token_ids: Tensor | None = None,
    ) -> None:
        tensor_header, payload = self._encoded(activations, self.codec, None)
        header = stage_pb2.ForwardHeader(
            run=self.run,
            microbatch=microbatch,
            route=route,
            activations=tensor_header,
            labels=labels.reshape(-1).tolist(),
            target_stage=target_stage,
            token_ids=[] if token_ids is None else token_ids.reshape(-1).tolist(),
        )
        messages = [stage_pb2.ForwardMessage(header=header)]
        messages += chunk_messages(stage_pb2.ForwardMessage, payload)
        # Counted with the header: labels and token ids cross the link too.
        await self._call(peer_id, "Forward", messages, len(payload) + header.ByteSize())

    async def backward(
        self,
        peer_id: str,
        *,
        microbatch: stage_pb2.MicrobatchId,
        target_stage: int,
        grad: Tensor | EncodedTensor,
        loss: float,
        num_tokens: int,
    ) -> None:
        tensor_header, payload = self._encoded(grad, self.gradient_codec, self.rounding)
        header = stage_pb2.BackwardHeader(
            run=self.run,
            microbatch=microbatch,
            grad=tensor_header,
            loss=loss,
            num_tokens=num_tokens,
            target_stage=target_stage,
        )
        messages = [stage_pb2.BackwardMessage(header=header)]
        messages += chunk_messages(stage_pb2.BackwardMessage, payload)
        await self._call(peer_id, "Backward", messages, len(payload))

    @staticmethod
    def _encoded(
        tensor: Tensor | EncodedTensor, codec: str, rounding: torch.Generator | None
    ) -> tuple[tensor_pb2.TensorHeader, bytes | memoryview]:
        """The header and payload of a hop: as the stage encoded it on its device, or encoded here.
        Activations and gradients are float32 on the wire's spec, whatever precision the stage
        handed over; the tensor is the stage's result, unchanged while it is sent, so a bf16 payload
        is a view of it."""
        if isinstance(tensor, EncodedTensor):
            if tensor.spec.codec != codec:
                raise ValueError(f"the stage encoded {tensor.spec.codec}, this link sends {codec}")
            return spec_to_header(tensor.spec), tensor.payload_view()
        return encode_tensor(tensor, codec, stochastic=rounding, dtype="float32", copy=False)

    async def _call(self, peer_id: str, method: str, messages: list, payload_bytes: int) -> None:
        stub, path = await self._stubs.get(peer_id)
        progress = Progress(self.deadlines.stall_s(peer_id, SENT))
        start = time.monotonic()
        call = getattr(stub, method)(
            paced(messages, progress), timeout=self.deadlines.total_s(peer_id, payload_bytes, SENT)
        )
        # After the last message: what flow control and the socket may still hold, then the peer's
        # answer (it acks once the payload is in: compute runs off the call).
        reply_s = progress.stall_s + self.deadlines.transfer_s(peer_id, min(payload_bytes, BUFFERED_BYTES), SENT)
        try:
            await while_sending(call, progress, call.cancel, reply_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, f"{peer_id[-8:]} ({path})") from None
        finally:
            if self.observe is not None:
                self.observe(method, time.monotonic() - start)
        self.deadlines.estimates.observe(peer_id, payload_bytes, time.monotonic() - start, SENT)
        self.bytes_sent += payload_bytes
        self.dialer.count_sent(path, payload_bytes)

    async def answers(self, peer_id: str) -> bool:
        """Whether the peer's health service answers within the link's progress deadline."""
        return await answers_health(self.dialer, peer_id, self.deadlines.stall_s(peer_id, SENT))

    async def close(self) -> None:
        self._stubs.clear()
