"""A gradient is taken only from a replica the microbatch went to. Found by a hostile-peer audit:
while our forward was still in flight (its accept not yet seen), or after every attempt failed, a
stranger that guessed the microbatch's key (origin and a counter) had its Backward accepted and the
honest gradient was then refused as unknown."""

import asyncio

import pytest

from noloco_node.codec.tensors import TensorSpec
from noloco_node.errors import UnknownMicrobatch
from noloco_node.pipeline.ports import BackwardCall, Hop, MicrobatchKey, Peer
from noloco_node.pipeline.router import Bans, Router
from noloco_node.pipeline.runtime import StageRuntime, Ticket
from noloco_node.pipeline.runtime_settings import RuntimeSettings, StageNetwork, StageShape

SHAPE = StageShape(stage=0, num_stages=2, boundary_width=4, seq_len=2, microbatch_size=1, vocab_size=8)
KEY = MicrobatchKey(origin="QmMe", sequence=7, attempt=0)


class Worker:
    inner_steps = 0

    def output_shape(self, key):
        return (1, 2, 4) if key == KEY else None


class NextStage:
    """One replica, QmHonest, whose accept of our forward arrives only when `accept` is set."""

    def __init__(self) -> None:
        self.accept = asyncio.Event()
        self.sending = asyncio.Event()

    async def replicas(self, stage: int) -> list[Peer]:
        return [Peer(peer_id="QmHonest", address="127.0.0.1:1")]

    def saw_address(self, peer_id: str, address: str) -> None:
        pass

    async def forward(self, peer: Peer, **_call) -> None:
        self.sending.set()
        await self.accept.wait()


def runtime(next_stage: NextStage) -> StageRuntime:
    network = StageNetwork(
        transport=next_stage, directory=next_stage, router=Router(Bans()), me=Hop("QmMe", "127.0.0.1:2", 0)
    )
    rt = StageRuntime(
        shape=SHAPE,
        worker=Worker(),
        compute=None,
        network=network,
        settings=RuntimeSettings(max_in_flight=4, send_deadline_s=5.0),
    )
    rt.in_flight[KEY] = Ticket(key=KEY, route=[])
    return rt


def gradient_from(rt: StageRuntime, caller: str) -> Ticket:
    call = BackwardCall(key=KEY, target_stage=0, loss=1.0, num_tokens=2)
    return rt.admit_backward(call, TensorSpec(dtype="float32", shape=(1, 2, 4), codec="none"), caller=caller)


async def test_before_the_accept_only_the_replica_it_went_to_may_send_its_gradient():
    next_stage = NextStage()
    rt = runtime(next_stage)
    with pytest.raises(UnknownMicrobatch, match="which the microbatch was not forwarded to"):
        gradient_from(rt, "QmStranger")  # not even sent yet
    sending = asyncio.create_task(rt.send_forward(KEY, [], output=None, labels=None))
    await asyncio.wait_for(next_stage.sending.wait(), 5)
    with pytest.raises(UnknownMicrobatch, match="which the microbatch was not forwarded to"):
        gradient_from(rt, "QmStranger")  # the forward is in flight, its accept not seen
    assert gradient_from(rt, "QmHonest").key == KEY  # a fast last stage may answer before its accept
    next_stage.accept.set()
    assert await asyncio.wait_for(sending, 5) == "QmHonest"
    with pytest.raises(UnknownMicrobatch):
        gradient_from(rt, "QmStranger")
    assert gradient_from(rt, "QmHonest").key == KEY


def test_a_ticket_names_its_gradient_senders():
    ticket = Ticket(key=KEY, route=[], sent_to={"QmA", "QmB"})
    assert ticket.gradient_may_come_from("QmA") and ticket.gradient_may_come_from("QmB")
    assert not ticket.gradient_may_come_from("QmC")
    ticket.downstream = "QmB"  # once one accepted, only that one
    assert not ticket.gradient_may_come_from("QmA") and ticket.gradient_may_come_from("QmB")


def forward_from(rt: StageRuntime, route: list[Hop], origin: str = "QmOrigin"):
    from noloco_node.pipeline.ports import ForwardCall

    call = ForwardCall(
        key=MicrobatchKey(origin=origin, sequence=3, attempt=0), target_stage=2, route=tuple(route), labels=[1, 2]
    )
    return rt.admit_forward(call, TensorSpec(dtype="float32", shape=(1, 2, 4), codec="none"))


def test_a_squatted_key_is_no_strike_against_the_honest_sender():
    """A stranger can send a forward under an honest stage-0 peer's next key first; the honest
    forward must then not earn INVALID_ARGUMENT (five of those ban the honest sender)."""
    from noloco_node.errors import InvalidPayload, ProtocolMismatch

    rt = runtime(NextStage())
    rt.shape = StageShape(stage=2, num_stages=3, boundary_width=4, seq_len=2, microbatch_size=1, vocab_size=8)
    origin = Hop("QmOrigin", "127.0.0.1:3", 0)
    forward_from(rt, [origin, Hop("QmStranger", "127.0.0.1:4", 1)])
    with pytest.raises(ProtocolMismatch, match="already in flight here, from another sender"):
        forward_from(rt, [origin, Hop("QmHonest", "127.0.0.1:5", 1)])
    with pytest.raises(InvalidPayload, match="already in flight here$"):
        forward_from(rt, [origin, Hop("QmStranger", "127.0.0.1:4", 1)])  # its own duplicate: a strike
