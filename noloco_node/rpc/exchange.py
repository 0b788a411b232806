"""Outer.Exchange's stream, the part both sides share (rpc/outer_service.py: the initiator's
OuterClient and the responder's OuterServicer): send our snapshot and receive the partner's at
once, each tensor checked against the expected list before it is allocated, and the receipts
compared. Both directions run concurrently, so neither side can block the other on flow control.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

import grpc
from torch import Tensor

from noloco_node.codec.checked import decode_checked
from noloco_node.errors import InvalidPayload, PeerUnavailable
from noloco_node.rpc.deadlines import ExchangeLimits, Progress, watch_exchange, within
from noloco_node.rpc.tensors import PayloadReceiver, chunk_messages, header_to_spec, spec_to_header
from noloco_node.runtime.faults import FaultInjector
from noloco_node.sync.ports import EncodedSnapshot, ExpectedTensor, check_tensor_count
from noloco_node.wire.v1 import outer_pb2

Screen = Callable[[dict[str, Tensor]], None]
"""Judges a partner's decoded snapshot; raises InvalidPayload (or PoisonedPayload) to refuse it."""


class Traffic:
    """Bytes this node wrote and read on Outer exchange streams, as initiator and as responder: each
    message serialized, with gRPC's 5-byte length prefix (what the snapshot costs on the wire,
    headers included)."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0


async def exchange_snapshots(
    read,
    write,
    mine: EncodedSnapshot,
    expected: list[ExpectedTensor],
    codec: str,
    max_bytes: int,
    traffic: Traffic | None = None,
    faults: FaultInjector | None = None,
    limits: ExchangeLimits | None = None,
    screen: Screen | None = None,
) -> dict[str, Tensor]:
    """Send `mine` and receive the partner's snapshot concurrently; returns the decoded tensors
    once both receipts check out. Raises InvalidPayload / PeerUnavailable otherwise, and
    TransferTimedOut past `limits` (rpc/deadlines.py: the total deadline for the bytes both ways,
    set once the partner's manifest is in, and the progress deadline). `screen` judges the
    partner's values before our receipt goes out (raising InvalidPayload), so a snapshot we will
    not use ends the call with an error on both sides, never with a matching receipt."""
    limits = limits or ExchangeLimits(total_s=lambda _: 3600.0, stall_s=3600.0)
    progress = Progress(limits.stall_s, asyncio.get_running_loop().time)
    stream = _ExchangeStream(read, write, progress, traffic, faults)
    sender = asyncio.create_task(stream.send(mine))
    receiver = asyncio.create_task(stream.receive(mine, expected, codec, max_bytes, limits, screen))
    for task in (sender, receiver):
        # When one direction fails, the other often fails too ('stream ended'): the exchange raises
        # the first, and the second is no "exception never retrieved" ERROR in the node's log.
        task.add_done_callback(_retrieved)
    try:
        await watch_exchange(receiver, sender, progress, stream.received_all)
        result = receiver.result()
        await within(sender, limits.stall_s, "writing our receipt")
        return result
    finally:
        for task in (sender, receiver):
            if not task.done():
                task.cancel()


def _same_size_bound(ours: int) -> int:
    """The most a partner's snapshot may announce against ours: equal, with 1% and 4 KiB spare."""
    return int(ours * 1.01) + 4096


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


class _ExchangeStream:
    """Our two directions of one exchange stream: the sender's receipt waits for the receiver's
    digest, and both stamp the progress the deadlines watch."""

    def __init__(self, read, write, progress: Progress, traffic: Traffic | None, faults: FaultInjector | None) -> None:
        self.read, self.write, self.progress = read, write, progress
        self.traffic, self.faults = traffic, faults
        self.received_all = asyncio.Event()
        self.received_hash: list[bytes] = []

    async def put(self, message) -> None:
        """Write one message, counting its bytes on the wire."""
        if self.faults is not None:
            await self.faults.hit("exchange_write")  # tests: a partner that dies (or stalls) mid-stream
        await self.write(message)
        self.progress.stamp_wrote()
        if self.traffic is not None:  # on the wire: the message and gRPC's 5-byte length prefix
            self.traffic.bytes_sent += message.ByteSize() + 5

    async def send(self, mine: EncodedSnapshot) -> None:
        """Our manifest, tensors and chunks, then, once the partner's payload is in, our receipt."""
        await self.put(
            outer_pb2.ExchangeMessage(
                manifest=outer_pb2.SnapshotManifest(num_tensors=len(mine.tensors), payload_bytes=mine.payload_bytes)
            )
        )
        for name, spec, payload in mine.tensors:
            await self.put(outer_pb2.ExchangeMessage(tensor=spec_to_header(spec, name)))
            for message in chunk_messages(outer_pb2.ExchangeMessage, payload):
                await self.put(message)
        if self.faults is not None:
            await self.faults.hit("during_exchange")
        await self.received_all.wait()
        receipt = outer_pb2.ExchangeMessage(receipt=outer_pb2.Receipt(sha256=self.received_hash[0]))
        await self.write(receipt)
        if self.traffic is not None:
            self.traffic.bytes_sent += receipt.ByteSize() + 5

    async def next_message(self, kind: str):
        """The next message's `kind` part; an abort, the stream's end or another kind raise."""
        message = await self.read()
        self.progress.stamp_read()
        if self.traffic is not None and message is not None and message is not grpc.aio.EOF:
            self.traffic.bytes_received += message.ByteSize() + 5
        if message is None:
            raise InvalidPayload(f"undecodable message while waiting for {kind}")
        if message is grpc.aio.EOF:
            raise PeerUnavailable(f"stream ended while waiting for {kind}")
        if message.WhichOneof("kind") == "abort":
            raise PeerUnavailable(f"partner aborted: {message.abort.reason}")
        if message.WhichOneof("kind") != kind:
            raise InvalidPayload(f"expected {kind}, got {message.WhichOneof('kind')}")
        return getattr(message, kind)

    async def receive(
        self,
        mine: EncodedSnapshot,
        expected: list[ExpectedTensor],
        codec: str,
        max_bytes: int,
        limits: ExchangeLimits,
        screen: Screen | None = None,
    ) -> dict[str, Tensor]:
        """The partner's tensors, once its receipt matches what we sent."""
        manifest = await self.next_message("manifest")
        check_tensor_count(manifest.num_tensors, expected)
        if manifest.payload_bytes > max_bytes:  # it would stretch the total deadline to the ceiling
            raise InvalidPayload(
                f"snapshot manifest announces {manifest.payload_bytes} bytes; the limit is {max_bytes}"
            )
        if manifest.payload_bytes > _same_size_bound(mine.payload_bytes):
            # Both sides send the same form and codecs of the same parameters: the same bytes. A
            # larger announcement only stretches the total deadline (a hostile-peer audit: 4.5x).
            raise InvalidPayload(
                f"snapshot manifest announces {manifest.payload_bytes} bytes; this round's snapshots are "
                f"{mine.payload_bytes}"
            )
        self.progress.set_total(limits.total_s(mine.payload_bytes + manifest.payload_bytes))
        began = self.progress.read
        out, digest, received = await _receive_tensors(self.next_message, expected, codec, max_bytes, self.progress)
        if received != manifest.payload_bytes:
            raise InvalidPayload(f"snapshot of {received} bytes; its manifest announced {manifest.payload_bytes}")
        if limits.observe is not None:
            limits.observe(manifest.payload_bytes, self.progress.clock() - began)
        if screen is not None:
            screen(out)  # raises before our receipt: no receipt, no pair step on either side
        self.received_hash.append(digest)
        self.received_all.set()
        receipt = await self.next_message("receipt")
        if receipt.sha256 != mine.sha256:
            raise InvalidPayload("partner's receipt does not match what we sent")
        return out


async def _receive_tensors(
    next_message, expected: list[ExpectedTensor], codec: str, max_bytes: int, progress: Progress
) -> tuple[dict[str, Tensor], bytes, int]:
    """The partner's tensors, each checked against `expected` before it is allocated, the
    SHA-256 of their payloads, and their bytes."""
    digest, out = hashlib.sha256(), {}
    budget = max_bytes
    for want in expected:
        header = await next_message("tensor")
        spec = header_to_spec(header)
        want.check(header.name, spec, codec)
        receiver = PayloadReceiver(spec, max_bytes=budget)
        while not receiver.complete:
            receiver.add(await next_message("chunk"))
        budget -= spec.payload_bytes
        payload = receiver.finish()
        digest.update(payload)
        out[want.name] = decode_checked(spec, payload)
        progress.stamp_read()  # decoding a large tensor is not the partner stalling
    return out, digest.digest(), max_bytes - budget
