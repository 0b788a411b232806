"""A state donor under hostile callers (rpc/state_service.py, rpc/state_slots.py, codec/top_up.py):
at most two FetchState streams at once and one per caller, refused RESOURCE_EXHAUSTED (`peer-busy`)
past that, a joiner that meets a busy donor asks another or the same one later, a cut whose caller
cancels at once ends without gRPC's error, and the top-up ledger records only what a stream wrote
whole, says `nothing-to-top-up` when it holds nothing, and keeps a joiner that copied a part of the
state against callers that fetched one parameter each."""

import asyncio
import contextlib

import grpc
import pytest
import torch
from grpc._cython import cygrpc

from noloco_node.codec.top_up import SentPhi
from noloco_node.errors import PeerBusy
from noloco_node.rpc.checks import ServedRun
from noloco_node.rpc.outer_service import OuterServicer
from noloco_node.rpc.state_slots import StreamSlots
from noloco_node.rpc.status import ERROR_KEY
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.link_estimates import DeadlinePolicy, LinkDeadlines, LinkEstimates
from noloco_node.sync import state_fetch
from noloco_node.sync.state_fetch import fetch_from_donors
from noloco_node.sync.transfer import expected_tensors
from noloco_node.wire.v1 import outer_pb2, outer_pb2_grpc

from .test_state_fetch import Donor, fresh_joiner, grpc_donors

DENSE, TOP_UP = outer_pb2.STATE_ENCODING_DENSE, outer_pb2.STATE_ENCODING_TOP_UP


def servicer(faults: FaultInjector | None = None, deadlines: LinkDeadlines | None = None) -> OuterServicer:
    return OuterServicer(
        None,
        peer_id="donor",
        run=ServedRun("r", "h", 0),
        max_bytes=1 << 24,
        deadlines=deadlines or LinkDeadlines(floor_s=10.0),
        donor=Donor(1),
        faults=faults,
    )


@contextlib.asynccontextmanager
async def donor_stub(outer: OuterServicer):
    server = grpc.aio.server()
    outer_pb2_grpc.add_OuterServicer_to_server(outer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield outer_pb2_grpc.OuterStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


def fetch(stub, caller: str, encoding=DENSE, names=()):
    request = outer_pb2.FetchStateRequest(stage=0, peer_id=caller, encoding=encoding, names=list(names))
    request.run.run_id, request.run.manifest_hash = "r", "h"
    return stub.FetchState(request, timeout=30)


async def refusal(call) -> tuple[grpc.StatusCode, str]:
    """The status and `noloco-error` key a call ended with (after reading it to the end)."""
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    return raised.value.code(), dict(raised.value.trailing_metadata() or ()).get(ERROR_KEY, "")


async def tensors_of(call) -> int:
    return sum([message.WhichOneof("kind") == "tensor" async for message in call])


def test_a_donor_serves_two_streams_at_once_one_per_caller_and_refuses_more_as_busy():
    async def scenario():
        stall = FaultInjector(["during_state_transfer:stall=30"])  # each stream holds after its manifest
        async with donor_stub(servicer(stall)) as stub:
            held_a, held_b = fetch(stub, "a"), fetch(stub, "b")
            assert (await held_a.read()).WhichOneof("kind") == "manifest"
            assert (await held_b.read()).WhichOneof("kind") == "manifest"
            again_a, third = await refusal(fetch(stub, "a")), await refusal(fetch(stub, "c"))
            held_a.cancel()  # its slot comes back once the donor sees the cancel
            for _ in range(100):
                c = fetch(stub, "c")
                first = await c.read()
                c.cancel()
                if first is not grpc.aio.EOF:
                    break
                await asyncio.sleep(0.05)
            held_b.cancel()
            return again_a, third, first

    again_a, third, first = asyncio.run(scenario())
    busy = (grpc.StatusCode.RESOURCE_EXHAUSTED, "peer-busy")
    assert again_a == busy and third == busy
    assert first.WhichOneof("kind") == "manifest"


def test_a_busy_donor_is_not_a_failed_one_its_part_goes_to_another_or_to_it_later(monkeypatch):
    monkeypatch.setattr(state_fetch, "BUSY_WAIT_S", 0.2)
    refusals, original = [0], StreamSlots.take

    def take(self, caller):  # the first `refusals` asks find the donor serving its most
        if refusals[0] > 0:
            refusals[0] -= 1
            raise PeerBusy("this donor already serves 2 state transfers (test)")
        original(self, caller)

    monkeypatch.setattr(StreamSlots, "take", take)
    donors = {"a": Donor(1), "b": Donor(1)}
    _, outer, _ = fresh_joiner()

    async def run(names):
        async with grpc_donors({n: donors[n] for n in names}) as (client, _):
            return await fetch_from_donors(
                client, names, stage=0, requester="joiner", timeout_s=20, expected=expected_tensors(outer)
            )

    refusals[0] = 2
    fetched = asyncio.run(run(["a", "b"]))  # both busy at first: each part is asked again after a wait
    assert fetched.failed == [] and fetched.busy == 2 and sum(fetched.parameters_from.values()) == 12
    refusals[0] = 2
    fetched = asyncio.run(run(["a"]))  # the only donor, busy twice: asked again until it serves
    assert fetched.failed == [] and fetched.busy == 2 and fetched.parameters_from == {"a": 12}


def test_a_cut_whose_caller_cancelled_at_the_same_moment_ends_quietly():
    """The donor cuts a reader that stopped; the caller cancels as it does, so gRPC fails to send
    the status (ExecuteBatchError): no error may escape the servicer (gRPC logged it, 16 at once)."""

    class StoppedReader:
        def __init__(self) -> None:
            self.written, self.aborted = 0, None

        async def write(self, message) -> None:
            self.written += 1
            if self.written > 1:  # the manifest went out; the next write never returns
                await asyncio.sleep(60)

        def time_remaining(self):
            return None

        async def abort(self, code, details, trailing_metadata=()):
            self.aborted = code
            raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendStatusFromServerOperation,)')

    policy = DeadlinePolicy(assumed_bytes_per_s=1e12, stall_s=0.2)
    outer = servicer(deadlines=LinkDeadlines(LinkEstimates(), policy, floor_s=0.2))
    context = StoppedReader()
    request = outer_pb2.FetchStateRequest(stage=0, peer_id="joiner")
    request.run.run_id, request.run.manifest_hash = "r", "h"
    asyncio.run(outer.FetchState(request, context))
    assert context.aborted == grpc.StatusCode.DEADLINE_EXCEEDED
    assert outer.state_donor.slots.open == {}  # its slot is free again
    assert outer.state_donor.sent.joiners() == []  # it got nothing whole


def test_a_stream_cancelled_after_its_manifest_gives_no_top_up_base_and_the_refusal_is_typed():
    async def scenario():
        stall = FaultInjector(["donate_parameter:stall=30@2"])  # parameter 1 goes out, then the donor waits
        outer = servicer(stall)
        async with donor_stub(outer) as stub:
            names = list(outer.state_donor.donor.outer.params)[:2]
            call = fetch(stub, "j", names=names)
            assert (await call.read()).WhichOneof("kind") == "manifest"
            while ("donate_parameter", "stall") not in stall.fired:
                await asyncio.sleep(0.02)
            call.cancel()  # the caller gives up: what it read of parameter 1 is unknown
            await asyncio.sleep(0.5)  # the donor sees the cancel
            return await refusal(fetch(stub, "j", TOP_UP, names[:1]))

    assert asyncio.run(scenario()) == (grpc.StatusCode.FAILED_PRECONDITION, "nothing-to-top-up")


def test_callers_fetching_one_parameter_each_do_not_evict_a_joiners_top_up_base():
    async def scenario():
        outer = servicer()
        async with donor_stub(outer) as stub:
            parameters = list(outer.state_donor.donor.outer.params)
            assert await tensors_of(fetch(stub, "joiner", names=parameters[:6])) == 24  # half the stage
            for stranger in ("x1", "x2", "x3"):
                assert await tensors_of(fetch(stub, stranger, names=parameters[:1])) == 4
            return await tensors_of(fetch(stub, "joiner", TOP_UP, parameters[:6])), outer.state_donor.sent

    topped_up, sent = asyncio.run(scenario())
    assert topped_up == 6 and "joiner" in sent.joiners()


def test_the_ledger_keeps_the_newest_and_of_the_others_the_one_holding_most():
    sent = SentPhi(keep_s=100.0, max_joiners=2, clock=lambda: 0.0)
    sent.commit("joiner", {f"p{i}": torch.zeros(100) for i in range(3)})
    sent.commit("x1", {"p0": torch.zeros(100)})
    sent.commit("x2", {"p0": torch.zeros(100)})  # the newest stays; of the others x1 holds less
    assert sent.joiners() == ["joiner", "x2"] and sent.held_bytes("joiner") == 1200
    sent.commit("big", {f"p{i}": torch.zeros(100) for i in range(5)})
    assert sent.joiners() == ["joiner", "big"]
    sent.commit("x1", {"p0": torch.zeros(100)})  # a newcomer is kept; the larger base stays too
    assert sent.joiners() == ["big", "x1"]


def test_in_churn_each_new_joiners_base_is_kept_for_its_top_up():
    """A hostile-peer audit's churn: two replicas copied 11 and 10 parameters from a donor, and
    every later joiner, taking 1 to 10 of them, had its top-up refused (its base was never kept)."""
    sent = SentPhi(keep_s=100.0, max_joiners=2, clock=lambda: 0.0)
    sent.commit("s1a", {f"p{i}": torch.zeros(100) for i in range(11)})
    sent.commit("s1c", {f"p{i}": torch.zeros(100) for i in range(10)})
    for joiner, parts in (("j1", 3), ("j2", 10), ("j3", 1), ("j4", 7)):
        sent.commit(joiner, {f"p{i}": torch.zeros(100) for i in range(parts)})
        assert sent.held(joiner, "p0") is not None  # its top-up comes next: it finds its base
    assert "s1a" in sent.joiners()  # the largest of the earlier ones stays beside the newest
