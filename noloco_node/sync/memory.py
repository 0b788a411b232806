"""In-memory twin of the pairing transport: replicas in one process propose, swap snapshots and
fetch state through a `MemoryPairingHub`, with the same decisions, validation and wire values as
over gRPC (rpc/outer_service.py), but no streams. The fast tier's swarms use it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from noloco_node.codec.checked import decode_checked
from noloco_node.codec.state_layout import STATE_BLOCK, ReceivedState, select_state, split_name, state_codec
from noloco_node.codec.top_up import SentPhi, phi_difference
from noloco_node.codec.tensors import decode, encode
from noloco_node.errors import InvalidPayload, PeerBusy, PeerUnavailable, ProtocolMismatch
from noloco_node.runtime.faults import FaultInjector
from noloco_node.sync.ports import (
    Decision,
    EncodedSnapshot,
    ExpectedTensor,
    PairingResponder,
    PairProposal,
    StateDonor,
    check_tensor_count,
)


def decode_snapshot(snapshot: EncodedSnapshot, expected: list[ExpectedTensor], codec: str) -> dict[str, Tensor]:
    """What a receiver decodes of `snapshot`, checked against `expected` as the gRPC receiver does."""
    check_tensor_count(len(snapshot.tensors), expected)
    out = {}
    for (name, spec, payload), want in zip(snapshot.tensors, expected):
        want.check(name, spec, codec)
        out[name] = decode_checked(spec, payload)
    return out


class MemoryPairingHub:
    """Every replica's responder and state donor, by peer id."""

    def __init__(self) -> None:
        self.responders: dict[str, PairingResponder] = {}
        self.donors: dict[str, StateDonor] = {}
        self.down: set[str] = set()
        self.transports: dict[str, MemoryPairing] = {}
        self.state_cut: dict[str, int] = {}
        """Tests: donor -> parameters of a state transfer it sends before it leaves mid-transfer."""
        self.sent: dict[str, SentPhi] = {}
        """Donor -> the phi each joiner holds of it, for top-ups (the gRPC donor's own, in one place)."""

    def register(self, peer_id: str, responder: PairingResponder | None, donor: StateDonor | None = None) -> None:
        if responder is not None:
            self.responders[peer_id] = responder
        if donor is not None:
            self.donors[peer_id] = donor

    def leave(self, peer_id: str) -> None:
        self.responders.pop(peer_id, None)
        self.donors.pop(peer_id, None)

    def transport(self, me: str, faults: FaultInjector | None = None) -> MemoryPairing:
        return self.transports.setdefault(me, MemoryPairing(self, me, faults))


class MemoryPairing:
    """sync.ports.PairingTransport over a MemoryPairingHub."""

    def __init__(self, hub: MemoryPairingHub, me: str, faults: FaultInjector | None = None) -> None:
        self.hub, self.me, self.faults = hub, me, faults
        self.bytes_sent = 0
        self.bytes_received = 0

    async def exchange(
        self,
        peer_id: str,
        proposal: PairProposal,
        mine: EncodedSnapshot,
        expected: list[ExpectedTensor],
        codec: str,
        *,
        timeout_s: float,
        screen: Callable[[dict[str, Tensor]], None] | None = None,
    ) -> dict[str, Tensor]:
        return await asyncio.wait_for(self._exchange(peer_id, proposal, mine, expected, codec, screen), timeout_s)

    def exchange_deadline_s(self, peer_id: str, payload_bytes: int) -> float:
        return 1.0  # a swap in memory takes no time on a link; this only backs up the responder's finish

    async def _exchange(
        self,
        peer_id: str,
        proposal: PairProposal,
        mine: EncodedSnapshot,
        expected: list[ExpectedTensor],
        codec: str,
        screen: Callable[[dict[str, Tensor]], None] | None,
    ) -> dict[str, Tensor]:
        responder = self.hub.responders.get(peer_id)
        if responder is None or peer_id in self.hub.down:
            raise PeerUnavailable(f"{peer_id} does not answer")
        answer = responder.decide(proposal)
        if answer.decision == Decision.MISMATCH:
            raise ProtocolMismatch(f"{peer_id}: {answer.reason}")
        if answer.decision != Decision.ACCEPT:
            raise PeerBusy(f"{peer_id}: {answer.decision.name} {answer.reason}".strip())
        theirs, their_expected, their_codec = responder.frozen()
        if self.faults is not None:
            await self.faults.hit("during_exchange")  # as the gRPC exchange does, once its payload is out
        self.bytes_sent += mine.payload_bytes
        self.bytes_received += theirs.payload_bytes
        partner = self.hub.transport(peer_id)
        partner.bytes_sent += theirs.payload_bytes
        partner.bytes_received += mine.payload_bytes
        try:
            received = decode_snapshot(theirs, expected, codec)
            delivered = decode_snapshot(mine, their_expected, their_codec)
        except InvalidPayload:
            await responder.finish(self.me, None, "rejected")
            raise
        try:  # both judged before either side's receipt, as over gRPC (rpc/exchange.py)
            responder.screen(delivered)
        except InvalidPayload as exc:  # over gRPC the responder's refusal reaches us as a failed call
            await responder.finish(self.me, None, "rejected")
            raise PeerUnavailable(f"{peer_id} refused our snapshot: {exc}") from None
        if screen is not None:
            try:
                screen(received)
            except InvalidPayload:
                await responder.finish(self.me, None, "failed")  # we refused theirs: the call ends in error
                raise
        await responder.finish(self.me, delivered, "paired")
        return received

    async def fetch_state(
        self,
        peer_id: str,
        *,
        stage: int,
        requester: str,
        timeout_s: float,
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
        names: Sequence[str] = (),
        compact: bool = False,
        into: ReceivedState | None = None,
    ) -> tuple[dict[str, Tensor], dict]:
        """As rpc/state_service.py: the parameters `names` (all when empty), grouped by parameter,
        each tensor through the codec the encoding gives its kind and checked against `expected`.
        A donor in `hub.state_cut` leaves after sending that many parameters (PeerUnavailable)."""
        into = into if into is not None else ReceivedState()
        tensors, counters = await self._donor_state(peer_id, timeout_s)
        try:
            selected = select_state(tensors, list(names))
        except ValueError as exc:  # the gRPC donor answers INVALID_ARGUMENT
            raise InvalidPayload(f"{peer_id} refused: {exc}") from None
        into.counters = json.loads(counters)
        for sent, parameter in enumerate(selected):
            if sent == self.hub.state_cut.get(peer_id):
                self.hub.leave(peer_id)
                raise PeerUnavailable(f"{peer_id} left after {sent} parameters")
            for name in selected[parameter]:
                tensor, want = tensors[name], expected.get(name)
                if want is None or tuple(tensor.shape) != want[0] or tensor.dtype != want[1] or name in into.tensors:
                    raise InvalidPayload(f"unexpected state tensor {name!r} {tensor.dtype}{list(tensor.shape)}")
                into.tensors[name] = decode(
                    *encode(tensor, state_codec(name, tensor.dtype, compact), block_size=STATE_BLOCK)
                )
                if split_name(name)[0] == "phi":
                    self.hub.sent.setdefault(peer_id, SentPhi()).record(requester, parameter, tensor)
            await asyncio.sleep(0)  # other donors' transfers interleave, as over the network
        return into.tensors, into.counters

    async def top_up_state(
        self,
        peer_id: str,
        *,
        stage: int,
        requester: str,
        timeout_s: float,
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
        names: Sequence[str],
    ) -> tuple[dict[str, Tensor], dict]:
        """As rpc/state_service.py's TOP_UP: phi/<p> of each parameter in `names` as the difference
        since what donor `peer_id` sent us, through the top-up's codec; refused for a parameter it
        sent us nothing of."""
        tensors, counters = await self._donor_state(peer_id, timeout_s)
        sent, out = self.hub.sent.get(peer_id, SentPhi()), {}
        for parameter in names:
            held, name = sent.held(requester, parameter), f"phi/{parameter}"
            if held is None or name not in expected:
                raise PeerUnavailable(f"{peer_id}: FAILED_PRECONDITION it sent us nothing of {parameter!r} to top up")
            spec, payload, holds = phi_difference(tensors[name], held)
            out[name] = decode(spec, payload)
            sent.record(requester, parameter, holds)
        return out, json.loads(counters)

    async def _donor_state(self, peer_id: str, timeout_s: float) -> tuple[dict[str, Tensor], str]:
        donor = self.hub.donors.get(peer_id)
        if donor is None or peer_id in self.hub.down:
            raise PeerUnavailable(f"{peer_id} does not donate state")
        return await asyncio.wait_for(donor.export_state(), timeout_s)

    async def close(self) -> None:
        return None


class MemoryAllReduceHub:
    """In-memory twin of the all-reduce (dht/averaging.py) for one stage's replicas: a round's mean
    (float64, rounded once to each tensor's dtype, as with hivemind in float64) once all
    `group_size` members have joined it, else, after the deadline, a group of one. A round's group
    forms once: a later attempt at the same round waits for a new group, as hivemind's does.

    Fault injection for tests: `partial` holds (member, round) pairs that receive only part of the
    mean (their own values for the rest, reported incomplete, as hivemind does), `absent` pairs that
    never join that round (so it fails for everyone), `late` pairs that join it that many seconds
    late, `unaware` pairs whose part is taken into the group while their own matchmaking reports
    failure (a group of one), so the others get an incomplete mean (seen with hivemind: "could not
    find a group" on one member, a partial round on the rest). `wait_s` caps one attempt's wait."""

    def __init__(self, group_size: int, *, wait_s: float | None = None) -> None:
        self.group_size, self.wait_s = group_size, wait_s
        self.partial: set[tuple[str, int]] = set()
        self.absent: set[tuple[str, int]] = set()
        self.unaware: set[tuple[str, int]] = set()
        self.late: dict[tuple[str, int], float] = {}
        """(member, round) -> seconds that member arrives late at that round."""
        self._forming: dict[int, _Group] = {}

    def member(self, name: str) -> MemoryAllReduce:
        return MemoryAllReduce(self, name)

    async def _join(self, name: str, tensors: list[Tensor], round_index: int, timeout_s: float) -> _Group | None:
        group = self._forming.setdefault(round_index, _Group())
        group.members[name] = [t.detach().to("cpu", torch.float64) for t in tensors]
        if len(group.members) == self.group_size:
            group.means = [torch.stack(ts).mean(0) for ts in zip(*group.members.values())]
            group.unaware = {m for m in group.members if (m, round_index) in self.unaware}
            self.unaware -= {(m, round_index) for m in group.unaware}
            del self._forming[round_index]
            group.done.set()
        try:
            await asyncio.wait_for(group.done.wait(), min(timeout_s, self.wait_s or timeout_s))
        except asyncio.TimeoutError:
            if group.done.is_set():  # the group formed as our wait ran out: we are in it
                return group
            group.members.pop(name, None)
            return None
        return group


class _Group:
    def __init__(self) -> None:
        self.members: dict[str, list[Tensor]] = {}
        self.means: list[Tensor] = []
        self.unaware: set[str] = set()
        self.done = asyncio.Event()


class MemoryAllReduce:
    """sync.ports.AllReduce for one member of a MemoryAllReduceHub."""

    def __init__(self, hub: MemoryAllReduceHub, name: str) -> None:
        self.hub, self.name = hub, name
        self.bytes_sent = 0

    async def mean(
        self, tensors: list[Tensor], timeout_s: float, round_index: int
    ) -> tuple[list[Tensor], int, bool, bool]:
        if (self.name, round_index) in self.hub.absent:
            return _alone(tensors)
        delay = self.hub.late.pop((self.name, round_index), 0.0)
        if delay:
            await asyncio.sleep(delay)
        group = await self.hub._join(self.name, tensors, round_index, timeout_s)
        if group is None:
            return _alone(tensors)
        self.bytes_sent += 2 * sum(t.numel() * t.element_size() for t in tensors)
        if self.name in group.unaware:
            return _alone(tensors)
        out = [m.to(t.dtype) for m, t in zip(group.means, tensors)]
        complete = (self.name, round_index) not in self.hub.partial and not group.unaware
        if not complete:  # the second half of the tensors never arrived: our own values stand
            half = len(out) // 2
            out = out[:half] + [t.clone() for t in tensors[half:]]
        return out, self.hub.group_size, True, complete

    def shutdown(self) -> None:
        return None


def _alone(tensors: list[Tensor]) -> tuple[list[Tensor], int, bool, bool]:
    """A group of one, as hivemind's averager reports a round nobody else joined: our own values."""
    return [t.clone() for t in tensors], 1, True, True
