"""Outer.Exchange: the pairwise snapshot exchange on one bidirectional stream.

Order on the stream (both directions run concurrently, so neither side can block the other on
flow control): initiator sends a PairRequest, responder answers a PairReply; on ACCEPT each side
sends a SnapshotManifest, then per tensor a TensorHeader and its chunks, and, once it has
received the partner's whole payload, a Receipt with the SHA-256 of what it received. A side
succeeds only when the partner's receipt matches the hash of what it sent. Everything is checked
against the expected tensor list before anything is allocated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc
import torch
from torch import Tensor

from noloco_node.codec.state_layout import ReceivedState
from noloco_node.errors import (
    InvalidPayload,
    NodeError,
    PeerBusy,
    PeerUnavailable,
    PoisonedPayload,
    ProtocolMismatch,
)
from noloco_node.rpc.admission import POISONED
from noloco_node.rpc.checks import ServedRun, check_caller
from noloco_node.rpc.deadlines import TransferTimedOut, exchange_limits, within
from noloco_node.rpc.exchange import Screen, Traffic, exchange_snapshots
from noloco_node.rpc.state_service import StateDonorServicer, StateFetcher
from noloco_node.rpc.status import abort_with, unavailable_from_rpc
from noloco_node.rpc.stubs import StubCache, answers_health
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.link_estimates import LinkDeadlines
from noloco_node.sync.ports import (
    Decision,
    EncodedSnapshot,
    ExpectedTensor,
    PairingResponder,
    PairProposal,
    StateDonor,
)
from noloco_node.wire.v1 import outer_pb2, outer_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)
ACCEPT = outer_pb2.PairReply.ACCEPT


_DECISIONS = {
    Decision.ACCEPT: outer_pb2.PairReply.ACCEPT,
    Decision.BUSY: outer_pb2.PairReply.BUSY,
    Decision.WAIT: outer_pb2.PairReply.WAIT,
    Decision.MISMATCH: outer_pb2.PairReply.MISMATCH,
}


def pair_proposal(request: outer_pb2.PairRequest) -> PairProposal:
    return PairProposal(
        peer_id=request.peer_id,
        stage=request.stage,
        round=request.round,
        inner_step=request.inner_step,
        nonce=bytes(request.nonce),
        sends_slow_weights=request.send_slow_weights,
    )


def pair_request(proposal: PairProposal) -> outer_pb2.PairRequest:
    return outer_pb2.PairRequest(
        stage=proposal.stage,
        round=proposal.round,
        inner_step=proposal.inner_step,
        peer_id=proposal.peer_id,
        nonce=proposal.nonce,
        send_slow_weights=proposal.sends_slow_weights,
    )


class OuterServicer(outer_pb2_grpc.OuterServicer):
    def __init__(
        self,
        handler: PairingResponder | None,
        *,
        peer_id: str,
        run: ServedRun,
        max_bytes: int,
        deadlines: LinkDeadlines,
        traffic: Traffic | None = None,
        donor: StateDonor | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        """`handler` answers pairing proposals (None: this node does not pair, e.g. a dp replica);
        `peer_id` is this node's, named in every reply; `run` names the run and stage it serves.
        `deadlines` (runtime/link_estimates.py) derives each exchange's deadline from the caller's
        measured bandwidth; its floor (timeouts.match_s) also bounds the wait for a PairRequest; a
        state transfer's is also never shorter than the joiner's own call deadline
        (rpc/state_service.py)."""
        self.handler, self.peer_id = handler, peer_id
        self.faults = faults
        self.traffic = traffic
        self.donor = donor
        self.run = run
        self.max_bytes, self.deadlines = max_bytes, deadlines
        self.timeout_s = deadlines.floor_s
        self.state_donor = StateDonorServicer(run=self.run, deadlines=deadlines, donor=donor, faults=faults)

    async def Exchange(self, request_iterator, context):
        try:  # a server-side deadline on the first message, whatever the client set
            first = await asyncio.wait_for(context.read(), self.timeout_s)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no PairRequest within {self.timeout_s:g} s")
        try:
            request = self._pair_request(first)
        except NodeError as error:
            await abort_with(context, error)
        answer = self.handler.decide(pair_proposal(request))
        reply = outer_pb2.PairReply(
            decision=_DECISIONS[answer.decision], reason=answer.reason, wait_s=answer.wait_s, peer_id=self.peer_id
        )
        await context.write(outer_pb2.ExchangeMessage(reply=reply))
        if answer.decision != Decision.ACCEPT:
            return
        mine, expected, codec = self.handler.frozen()
        try:  # the caller's announced payload_bytes and our estimate of its link set the deadline
            received = await exchange_snapshots(
                context.read,
                context.write,
                mine,
                expected,
                codec,
                self.max_bytes,
                self.traffic,
                self.faults,
                exchange_limits(self.deadlines, request.peer_id),
                self.handler.screen,  # before our receipt: a snapshot we refuse pairs neither side
            )
        except asyncio.CancelledError:  # the caller vanished: the round must still end (solo)
            await self.handler.finish(request.peer_id, None, "failed")
            raise
        except (NodeError, asyncio.TimeoutError, grpc.aio.AioRpcError) as exc:
            await self.handler.finish(request.peer_id, None, _reason(exc))
            if isinstance(exc, TransferTimedOut):
                log.info("exchange with %s cut: %s", request.peer_id[-8:], exc)
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"exchange cut: {exc}")
            if isinstance(exc, PeerUnavailable):
                # The caller ended or aborted its own exchange: not malformed data (an honest
                # partner does this when its deadline passes), so not a strike towards a ban.
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"exchange ended early: {exc}")
            if isinstance(exc, PoisonedPayload):
                POISONED.set(True)  # values that would corrupt the stage: its sender is banned at once
            if isinstance(exc, NodeError):
                await abort_with(context, exc)
            return
        await self.handler.finish(request.peer_id, received, "paired")

    def _pair_request(self, first) -> outer_pb2.PairRequest:
        """The PairRequest an Exchange starts with, from the signed caller, for this run and stage,
        to a node that pairs; raises the node error to answer otherwise."""
        if first is grpc.aio.EOF or first is None or first.WhichOneof("kind") != "request":
            raise InvalidPayload("Exchange must start with a PairRequest")
        request = first.request
        check_caller(request.peer_id, "PairRequest")
        self.run.check(request.run, request.stage)
        if self.handler is None:
            raise ProtocolMismatch("this node does not pair (outer.method is not noloco)")
        return request

    async def FetchState(self, request, context):
        """Outer.FetchState: rpc/state_service.py."""
        return await self.state_donor.FetchState(request, context)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (asyncio.TimeoutError, TransferTimedOut)):
        return "timed_out"
    if isinstance(exc, InvalidPayload):
        return "rejected"
    return "failed"


class OuterClient:
    """Pairing exchanges and state fetches, by peer id, through the dialer (transport/dialer.py)."""

    def __init__(
        self,
        *,
        run_id: str,
        manifest_hash: str,
        max_bytes: int,
        dialer,
        traffic: Traffic | None = None,
        faults: FaultInjector | None = None,
        deadlines: LinkDeadlines | None = None,
    ) -> None:
        """`deadlines` (runtime/link_estimates.py) derives an exchange's deadline from the partner's
        measured bandwidth, never under its floor (timeouts.match_s); None: a fresh estimator with
        the default policy and no floor."""
        self.run = tensor_pb2.RunIdentity(run_id=run_id, manifest_hash=manifest_hash)
        self.dialer = dialer
        self.faults = faults
        self.deadlines = deadlines or LinkDeadlines()
        self.max_bytes = max_bytes
        self.traffic = traffic or Traffic()
        self.state = StateFetcher(run=self.run, max_bytes=max_bytes, deadlines=self.deadlines, faults=faults)
        self._stubs = StubCache(dialer, outer_pb2_grpc.OuterStub)

    def exchange_deadline_s(self, peer_id: str, payload_bytes: int) -> float:
        """The longest an exchange moving `payload_bytes` (both ways) with the peer may run."""
        return self.deadlines.total_s(peer_id, payload_bytes) + self.deadlines.stall_s(peer_id)

    @property
    def bytes_sent(self) -> int:
        """Outer payload bytes this node wrote, as initiator and (sharing `traffic`) as responder."""
        return self.traffic.bytes_sent

    @property
    def bytes_received(self) -> int:
        """Outer payload bytes this node read, the same way."""
        return self.traffic.bytes_received

    async def _stub(self, peer_id: str) -> outer_pb2_grpc.OuterStub:
        stub, _ = await self._stubs.get(peer_id)
        return stub

    async def exchange(
        self,
        to: str,
        proposal: PairProposal,
        mine: EncodedSnapshot,
        expected: list[ExpectedTensor],
        codec: str,
        *,
        timeout_s: float,
        screen: Screen | None = None,
    ) -> dict[str, Tensor]:
        """Propose a pair and, if accepted, exchange snapshots. Raises PeerBusy when refused.
        `timeout_s` bounds the wait for the partner's answer (the rest of the matching window); the
        exchange then gets the deadline derived from the bytes both ways at the partner's measured
        bandwidth, and the progress deadline (rpc/deadlines.py: TransferTimedOut)."""
        request = pair_request(proposal)
        request.run.CopyFrom(self.run)
        limits = exchange_limits(self.deadlines, to)
        # gRPC's own deadline only backs ours up: the derived one is known once the sizes are.
        call = (await self._stub(to)).Exchange(timeout=timeout_s + self.deadlines.policy.ceiling_s + limits.stall_s)
        try:
            asked = time.monotonic()
            await call.write(outer_pb2.ExchangeMessage(request=request))
            reply_message = await within(call.read(), timeout_s, f"waiting for {to[-8:]} to answer our proposal")
            self.deadlines.estimates.observe_rtt(to, time.monotonic() - asked)
            if reply_message is grpc.aio.EOF or reply_message.WhichOneof("kind") != "reply":
                raise PeerUnavailable(f"{to} closed the exchange without a reply")
            reply = reply_message.reply
            if reply.decision == outer_pb2.PairReply.MISMATCH:
                raise ProtocolMismatch(f"{to}: {reply.reason}")
            if reply.decision != ACCEPT:
                raise PeerBusy(f"{to}: {outer_pb2.PairReply.Decision.Name(reply.decision)} {reply.reason}".strip())
            received = await exchange_snapshots(
                call.read, call.write, mine, expected, codec, self.max_bytes, self.traffic, self.faults, limits, screen
            )
            await call.done_writing()
            # EOF once the partner has read our receipt and closed its side
            await within(call.read(), limits.stall_s, f"waiting for {to[-8:]} to close the exchange")
            return received
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            raise unavailable_from_rpc(exc, to) from None
        except asyncio.InvalidStateError:
            # A write after the partner ended the call (raised by an intercepted call instead of
            # the AioRpcError a plain one gives): the exchange failed, like any dropped partner.
            call.cancel()
            raise PeerUnavailable(f"{to}: the partner ended the exchange") from None
        except BaseException:
            call.cancel()
            raise

    async def fetch_state(
        self,
        to: str,
        *,
        stage: int,
        requester: str,
        timeout_s: float,
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
        names: Sequence[str] = (),
        compact: bool = False,
        into: ReceivedState | None = None,
    ) -> tuple[dict[str, Tensor], dict]:
        """A donor's state of `names` (all when empty), dense or compact: rpc/state_service.py."""
        return await self.state.fetch(
            await self._stub(to),
            to,
            stage=stage,
            requester=requester,
            timeout_s=timeout_s,
            expected=expected,
            names=names,
            compact=compact,
            into=into,
        )

    async def top_up_state(
        self,
        to: str,
        *,
        stage: int,
        requester: str,
        timeout_s: float,
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
        names: Sequence[str],
    ) -> tuple[dict[str, Tensor], dict]:
        """The difference of a donor's phi of `names` since what it sent us (sync/top_up.py), as
        phi/<p> tensors, and its counters now."""
        return await self.state.fetch(
            await self._stub(to),
            to,
            stage=stage,
            requester=requester,
            timeout_s=timeout_s,
            expected=expected,
            names=names,
            top_up=True,
        )

    async def answers(self, peer_id: str, timeout_s: float) -> bool:
        """Whether `peer_id` answers a health check where its record says it serves (TLS pinned to
        its record): a record announcing a replica far ahead at a dead address (a hostile-peer
        audit) is no reason to leave the stage to copy its state."""
        return await answers_health(self.dialer, peer_id, timeout_s)

    async def close(self) -> None:
        self._stubs.clear()
