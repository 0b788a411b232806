"""Outer.FetchState, both sides: a donor streams the state of the parameters a joiner asks for, in
the encoding it asks for (codec/state_layout.py says what travels exactly and what compactly); the
joiner checks every tensor against what it asked for before allocating it.

Order on the stream: a StateManifest (the donor's counters), then per parameter asked for its
tensors (phi, momentum, Adam's two moments), each a TensorHeader and its chunks. Grouping by
parameter lets a joiner whose donor dies mid-stream keep the parameters it received whole
(`ReceivedState`) and ask another donor for the rest (sync/state_fetch.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence

import grpc
import torch
from torch import Tensor

from noloco_node.codec.state_layout import (
    MAX_REQUESTED_NAMES,
    STATE_BLOCK,
    ReceivedState,
    select_state,
    split_name,
    state_codec,
    state_spec,
)
from noloco_node.codec.checked import decode_checked
from noloco_node.codec.top_up import SentPhi, phi_difference
from noloco_node.codec.tensors import DTYPES, TensorSpec, encode
from noloco_node.errors import InvalidPayload, NodeError, NothingToTopUp, PeerBusy, ProtocolMismatch
from noloco_node.rpc.checks import ServedRun, check_caller
from noloco_node.rpc.deadlines import Progress, TransferTimedOut, within
from noloco_node.rpc.state_slots import StreamSlots
from noloco_node.rpc.status import abort_with, unavailable_from_rpc
from noloco_node.rpc.tensors import PayloadReceiver, chunk_messages, header_to_spec, spec_to_header
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.link_estimates import RECEIVED, SENT, LinkDeadlines
from noloco_node.sync.ports import StateDonor
from noloco_node.wire.v1 import outer_pb2, outer_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)

COMPACT = outer_pb2.STATE_ENCODING_COMPACT
DENSE = outer_pb2.STATE_ENCODING_DENSE
TOP_UP = outer_pb2.STATE_ENCODING_TOP_UP


class StateDonorServicer:
    """The donor side of Outer.FetchState (OuterServicer hands its calls here). At most
    `slots.total` streams at once, `slots.per_caller` per caller (rpc/state_slots.py)."""

    def __init__(
        self,
        *,
        run: ServedRun,
        deadlines: LinkDeadlines,
        donor: StateDonor | None,
        faults: FaultInjector | None = None,
        slots: StreamSlots | None = None,
    ) -> None:
        self.run, self.deadlines, self.donor, self.faults = run, deadlines, donor, faults
        self.slots = slots or StreamSlots()
        self.sent = SentPhi()  # the phi each joiner holds of ours, for its top-up (codec/top_up.py)

    def _check(self, request) -> None:
        """Raises the node error to answer a request this donor does not serve."""
        if request is None:
            raise InvalidPayload("undecodable FetchStateRequest")
        self.run.check(request.run, request.stage)
        check_caller(request.peer_id, "FetchStateRequest")
        if request.encoding not in (DENSE, COMPACT, TOP_UP):
            raise InvalidPayload(
                f"unknown state encoding {request.encoding}; use STATE_ENCODING_DENSE, _COMPACT or _TOP_UP"
            )
        if len(request.names) > MAX_REQUESTED_NAMES:  # before copying anything
            raise InvalidPayload(
                f"{len(request.names)} parameters asked for; at most {MAX_REQUESTED_NAMES} per request"
            )
        if self.donor is None:
            raise ProtocolMismatch("this node does not donate state")

    async def FetchState(self, request, context):
        try:
            self._check(request)
            self.slots.take(request.peer_id)  # before the copy: each stream holds one
        except NodeError as error:
            await abort_with(context, error)
        try:
            await self._serve(request, context)
        finally:
            self.slots.give(request.peer_id)

    async def _serve(self, request, context) -> None:
        top_up = request.encoding == TOP_UP
        try:
            tensors, counters = await self.donor.export_state()
            selected = _selected(tensors, request)
            bases = self._bases(request.peer_id, selected) if top_up else None
        except NodeError as error:
            await abort_with(context, error)
        compact = request.encoding == COMPACT
        # Only what this stream sends stays; each tensor is dropped once written.
        tensors = {name: tensors[name] for names in selected.values() for name in names}
        specs = {n: state_spec(n, tuple(t.shape), t.dtype, compact, top_up) for n, t in tensors.items()}
        payload_bytes = sum(spec.payload_bytes for spec in specs.values())
        manifest = _manifest(counters, len(tensors), payload_bytes)
        staged: dict[str, Tensor] = {}  # parameter -> the phi the caller holds once its last chunk went out
        try:
            await self._send_state(
                context, request.peer_id, manifest, selected, tensors, compact, payload_bytes, bases, staged
            )
        except TransferTimedOut as exc:  # it stopped reading: it holds what was written whole
            self._settle(request.peer_id, top_up, staged if not top_up else None)
            await _end_cut(context, request.peer_id, exc)
            return
        except BaseException:  # it cancelled (or we failed): what it read is unknown
            self._settle(request.peer_id, top_up, None)
            raise
        self._settle(request.peer_id, top_up, staged)

    def _bases(self, joiner: str, selected: dict[str, list[str]]) -> dict[str, Tensor]:
        """A top-up's bases: the phi `joiner` holds of each parameter (the ledger may drop it
        meanwhile); raises NothingToTopUp when it holds none of some."""
        bases = {p: self.sent.held(joiner, p) for p in selected}
        if missing := [p for p, held in bases.items() if held is None]:
            raise NothingToTopUp(
                f"nothing sent to {joiner[-8:]} of {len(missing)} parameters (e.g. {missing[0]!r}) to top "
                "up: fetch them first (STATE_ENCODING_COMPACT)"
            )
        return bases

    def _settle(self, joiner: str, top_up: bool, staged: dict[str, Tensor] | None) -> None:
        """Into the ledger: what a stream gave `joiner` (None: unknown). A top-up that did not
        end leaves us unsure what the joiner holds: it has nothing more to top up here."""
        if staged is None and top_up:
            self.sent.forget(joiner)
        elif staged:
            self.sent.commit(joiner, staged)

    async def _send_state(
        self,
        context,
        requester: str,
        manifest,
        selected: dict[str, list[str]],
        tensors: dict[str, Tensor],
        compact: bool,
        payload_bytes: int,
        bases: dict[str, Tensor] | None,
        staged: dict[str, Tensor],
    ) -> None:
        """Written, not yielded, so that each write has the progress deadline (a requester that
        stops reading is cut) and the whole the deadline derived from its measured bandwidth.
        Each tensor is encoded just before it is sent, off the event loop (an int8 pass over a
        large matrix would otherwise hold up this node's pipeline traffic), and dropped once
        written. A parameter's phi is staged for the ledger once its last tensor went out whole."""
        progress = Progress(self.deadlines.stall_s(requester, SENT))
        total_s = self.deadlines.total_s(requester, payload_bytes, SENT)
        # Never shorter than the joiner's own call deadline (its floor is timeouts.rpc_s; ours is the
        # outer exchange's match_s, which cut a compact transfer on a loaded machine at 1 s), and
        # never past the policy's ceiling, whatever deadline a caller asks for.
        remaining = context.time_remaining()
        if remaining:
            total_s = max(total_s, min(remaining, self.deadlines.policy.ceiling_s))
        progress.set_total(total_s)

        async def put(message) -> None:
            await within(context.write(message), progress.check(reads_only=False), f"sending state to {requester[-8:]}")
            progress.stamp_wrote()

        await put(manifest)
        if self.faults is not None:
            await self.faults.hit("during_state_transfer")
        for parameter, names in selected.items():
            if self.faults is not None:
                await self.faults.hit("donate_parameter")  # tests: a donor that dies between parameters
            holds = None
            for name in names:
                tensor = tensors.pop(name)
                if bases is not None:  # a top-up: the difference from what the joiner holds
                    spec, payload, holds = await asyncio.to_thread(phi_difference, tensor, bases[parameter])
                else:
                    codec = state_codec(name, tensor.dtype, compact)
                    spec, payload = await asyncio.to_thread(encode, tensor, codec, block_size=STATE_BLOCK)
                    if split_name(name)[0] == "phi":  # sent exact: the joiner holds this very tensor
                        holds = tensor
                del tensor
                progress.stamp_wrote()  # encoding is not the requester stalling
                await put(outer_pb2.StateMessage(tensor=spec_to_header(spec, name)))
                for message in chunk_messages(outer_pb2.StateMessage, payload):
                    await put(message)
                del payload
            if holds is not None:
                staged[parameter] = holds
        # No bandwidth sample here: a server stream's writes return once the bytes are buffered
        # (socket buffers and HTTP/2 windows hold megabytes), long before they arrive, so bytes
        # over write time measured thousands of Mbit/s on a 0.6 Mbit/s link, and every later
        # exchange with this requester got the floor as its deadline (benchmarks/wan_utilisation.py).
        # The requester times the arrival (RECEIVED), which is the link.


def _selected(tensors: dict[str, Tensor], request) -> dict[str, list[str]]:
    """The tensors a request gets, grouped by parameter (a top-up: phi/<p> alone); raises
    InvalidPayload for names the stage does not have."""
    try:
        selected = select_state(tensors, list(request.names))
    except ValueError as exc:
        raise InvalidPayload(f"FetchStateRequest: {exc}") from None
    if request.encoding == TOP_UP:
        return {p: [f"phi/{p}"] for p, names in selected.items() if f"phi/{p}" in names}
    return selected


def _manifest(counters: str, num_tensors: int, payload_bytes: int) -> outer_pb2.StateMessage:
    counters_dict = json.loads(counters)
    return outer_pb2.StateMessage(
        manifest=outer_pb2.StateManifest(
            inner_step=int(counters_dict["inner_step"]),
            outer_round=int(counters_dict["outer_round"]),
            num_tensors=num_tensors,
            payload_bytes=payload_bytes,
            counters_json=counters,
        )
    )


async def _end_cut(context, requester: str, exc: TransferTimedOut) -> None:
    """End a stream the donor cut with DEADLINE_EXCEEDED. A caller that cancelled at the same
    moment has ended the call already: gRPC then fails to send the status (ExecuteBatchError,
    which it logged as an unhandled error with its traceback), and there is nobody to tell."""
    log.info("state transfer to %s cut: %s", requester[-8:], exc)
    try:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"state transfer cut: {exc}")
    except grpc.aio.AbortError:
        raise
    except Exception as error:  # noqa: BLE001 - grpc's ExecuteBatchError: the call is over
        log.debug("state transfer to %s: the call ended before the cut's status went out (%r)", requester[-8:], error)


class StateFetcher:
    """The joiner side of Outer.FetchState (OuterClient.fetch_state hands its calls here)."""

    def __init__(
        self,
        *,
        run: tensor_pb2.RunIdentity,
        max_bytes: int,
        deadlines: LinkDeadlines,
        faults: FaultInjector | None = None,
    ) -> None:
        self.run, self.max_bytes, self.deadlines, self.faults = run, max_bytes, deadlines, faults

    async def fetch(
        self,
        stub: outer_pb2_grpc.OuterStub,
        to: str,
        *,
        stage: int,
        requester: str,
        timeout_s: float,
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
        names: Sequence[str] = (),
        compact: bool = False,
        into: ReceivedState | None = None,
        top_up: bool = False,
    ) -> tuple[dict[str, Tensor], dict]:
        """The state of `names` (all when empty) from donor `to` (with `top_up`, its phi's difference
        since what it sent us: codec/top_up.py), each tensor checked against `expected` (exactly
        what was asked for) and its kind's codec before it is allocated. Deadline: `timeout_s` or
        the state's size at the donor's measured bandwidth times the slack, whichever is longer;
        after the manifest a donor silent for the progress deadline is cut (TransferTimedOut).
        `into` receives the counters and each tensor as it arrives (kept past a failure)."""
        into = into if into is not None else ReceivedState()
        encoding = TOP_UP if top_up else COMPACT if compact else DENSE
        request = outer_pb2.FetchStateRequest(
            run=self.run, stage=stage, peer_id=requester, names=names, encoding=encoding
        )
        state_bytes = sum(
            state_spec(n, shape, dtype, compact, top_up).payload_bytes for n, (shape, dtype) in expected.items()
        )
        total_s = self.deadlines.floored(timeout_s).total_s(to, state_bytes, RECEIVED)
        stall_s = self.deadlines.stall_s(to, RECEIVED)
        call = stub.FetchState(request, timeout=total_s)
        try:
            first = await call.read()  # the donor copies its state first: only the total deadline here
            began = time.monotonic()
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "manifest":
                raise InvalidPayload(f"{to} did not start FetchState with a manifest")
            manifest = first.manifest
            if self.faults is not None:
                await self.faults.hit("during_state_transfer")
            if manifest.num_tensors > len(expected) or manifest.payload_bytes > state_bytes:
                raise InvalidPayload(f"{to} declares {manifest.num_tensors} tensors / {manifest.payload_bytes} bytes")
            into.counters = json.loads(manifest.counters_json)
            await self._state_tensors(
                lambda: within(call.read(), stall_s, f"receiving state from {to[-8:]}"),
                manifest.num_tensors,
                expected,
                (compact, top_up),
                into.tensors,
            )
            self.deadlines.estimates.observe(to, manifest.payload_bytes, time.monotonic() - began, RECEIVED)
            return into.tensors, into.counters
        except grpc.aio.AioRpcError as exc:
            raise _refused(exc, to) from None
        except ValueError as exc:  # e.g. counters that are not JSON
            call.cancel()
            raise InvalidPayload(f"{to}: {exc}") from None
        except BaseException:
            call.cancel()  # we gave up early (a stalled donor, a bad tensor): free the stream
            raise

    async def _state_tensors(
        self, read, count: int, expected: dict, encoding: tuple[bool, bool], out: dict[str, Tensor]
    ) -> None:
        for _ in range(count):
            message = await read()
            if message is grpc.aio.EOF or message.WhichOneof("kind") != "tensor":
                raise InvalidPayload("expected a tensor header")
            header, spec = message.tensor, header_to_spec(message.tensor)
            _check_header(header.name, spec, expected.get(header.name), encoding, out)
            receiver = PayloadReceiver(spec, max_bytes=self.max_bytes)
            while not receiver.complete:
                chunk = await read()
                if chunk is grpc.aio.EOF or chunk.WhichOneof("kind") != "chunk":
                    raise InvalidPayload("state stream ended inside a tensor")
                receiver.add(chunk.chunk)
            tensor = decode_checked(spec, receiver.finish())
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise InvalidPayload(f"state tensor {header.name!r} is not finite")
            out[header.name] = tensor


def _refused(exc: grpc.aio.AioRpcError, donor: str) -> NodeError:
    """A failed FetchState as the joiner acts on it: PeerBusy for RESOURCE_EXHAUSTED (the donor
    serves its most transfers: ask another, or it again later), else PeerUnavailable."""
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return PeerBusy(f"{donor}: RESOURCE_EXHAUSTED {exc.details() or ''}".strip())
    return unavailable_from_rpc(exc, donor)


def _check_header(
    name: str,
    spec: TensorSpec,
    want: tuple[tuple[int, ...], torch.dtype] | None,
    encoding: tuple[bool, bool],
    received: dict,
) -> None:
    """A tensor the joiner did not ask for, sent twice, of another shape or dtype, or in another
    codec than the encoding (compact, top_up) gives its kind (phi is always exact, except in a
    top-up) is refused before allocation."""
    if want is None or name in received:
        raise InvalidPayload(f"unexpected state tensor {name!r}" + (" (sent twice)" if want is not None else ""))
    codec = state_codec(name, want[1], *encoding)
    if spec.shape != want[0] or DTYPES.get(spec.dtype) != want[1] or spec.codec != codec:
        raise InvalidPayload(
            f"state tensor {name!r} {spec.dtype}{list(spec.shape)}/{spec.codec} does not match "
            f"{want[1]}{list(want[0])}/{codec}"
        )
