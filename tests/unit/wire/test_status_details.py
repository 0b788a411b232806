"""Errors cross gRPC by status code and a typed detail (rpc/status.py), never by message text;
the run and caller checks every servicer asks (rpc/checks.py); the stub cache (rpc/stubs.py)."""

import asyncio

import grpc
import pytest

from noloco_node.errors import (
    InvalidPayload,
    NodeError,
    PeerBusy,
    PeerUnavailable,
    PoisonedPayload,
    ProtocolMismatch,
    TooLarge,
    UnknownMicrobatch,
)
from noloco_node.rpc.admission import CALLER
from noloco_node.rpc.checks import ServedRun, check_caller
from noloco_node.rpc.status import ERROR_KEY, abort_with, error_from_rpc, unavailable_from_rpc
from noloco_node.rpc.stubs import StubCache
from noloco_node.wire.v1 import tensor_pb2

REFUSALS: dict[bytes, NodeError] = {
    b"unknown": UnknownMicrobatch("no saved input for microbatch k (expired or never seen)"),
    b"not forwarded": UnknownMicrobatch("gradient for k from 12345678, which the microbatch was not forwarded to"),
    b"mismatch": ProtocolMismatch("request for run 'x'/'y'; this node serves run 'r'/'m'"),
    b"busy": PeerBusy("8/8 microbatches in flight"),
    b"too large": TooLarge("header of 2000000 bytes exceeds the 1048576-byte limit"),
    b"invalid": InvalidPayload("chunk 1 arrived where chunk 0 was expected"),
    b"poisoned": PoisonedPayload("values are not finite"),
}


async def _handle(request: bytes, context):
    if request == b"text only":  # what an older node sends: the words, no detail
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no saved input for microbatch k")
    if request == b"forged":  # a detail that would turn one kind of refusal into another
        forged = ((ERROR_KEY, "unknown-microbatch"),)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "x", trailing_metadata=forged)
    if request == b"gone":
        await context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")
    await abort_with(context, REFUSALS[request])


def _answers(requests: list[bytes]) -> dict[bytes, grpc.aio.AioRpcError]:
    async def scenario():
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(_handle)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"Call": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/t.T/Call")
                for request in requests:
                    with pytest.raises(grpc.aio.AioRpcError) as raised:
                        await call(request, timeout=10)
                    out[request] = raised.value
        finally:
            await server.stop(None)
        return out

    return asyncio.run(scenario())


def test_each_refusal_keeps_its_status_code_and_carries_its_error_code():
    answers = _answers(list(REFUSALS))
    codes = {
        request: (exc.code().name, dict(exc.trailing_metadata()).get(ERROR_KEY)) for request, exc in answers.items()
    }
    assert codes == {
        b"unknown": ("FAILED_PRECONDITION", "unknown-microbatch"),
        b"not forwarded": ("FAILED_PRECONDITION", "unknown-microbatch"),
        b"mismatch": ("FAILED_PRECONDITION", "protocol-mismatch"),
        b"busy": ("RESOURCE_EXHAUSTED", "peer-busy"),
        b"too large": ("RESOURCE_EXHAUSTED", "too-large"),
        b"invalid": ("INVALID_ARGUMENT", "invalid-payload"),
        b"poisoned": ("INVALID_ARGUMENT", "poisoned-payload"),
    }
    assert all(exc.details() == str(REFUSALS[request]) for request, exc in answers.items())


def test_the_client_tells_an_unknown_microbatch_by_its_detail_not_its_words():
    answers = _answers([*REFUSALS, b"text only", b"forged", b"gone"])
    errors = {request: error_from_rpc(exc, "peer") for request, exc in answers.items()}
    kinds = {request: type(error) for request, error in errors.items()}
    assert kinds == {
        b"unknown": UnknownMicrobatch,
        b"not forwarded": UnknownMicrobatch,
        b"mismatch": ProtocolMismatch,
        # As before the detail: every RESOURCE_EXHAUSTED is "busy, try another", every INVALID_ARGUMENT ours.
        b"busy": PeerBusy,
        b"too large": PeerBusy,
        b"invalid": InvalidPayload,
        b"poisoned": InvalidPayload,
        b"text only": ProtocolMismatch,
        b"forged": InvalidPayload,
        b"gone": PeerUnavailable,
    }
    assert str(errors[b"unknown"]) == "peer: no saved input for microbatch k (expired or never seen)"
    assert str(errors[b"invalid"]) == "peer rejected our payload: chunk 1 arrived where chunk 0 was expected"
    assert str(errors[b"gone"]) == "peer: UNAVAILABLE shutting down"
    # A transfer partner that ended the stream is unavailable, whatever the code.
    lost = unavailable_from_rpc(answers[b"invalid"], "peer")
    assert str(lost) == "peer: INVALID_ARGUMENT chunk 1 arrived where chunk 0 was expected"


def _run(run_id="r", manifest_hash="m"):
    return tensor_pb2.RunIdentity(run_id=run_id, manifest_hash=manifest_hash)


def test_a_request_of_another_run_manifest_or_stage_is_a_protocol_mismatch():
    ServedRun("r", "m").check(_run())
    ServedRun("r", "m", stage=1).check(_run(), 1)
    with pytest.raises(ProtocolMismatch, match="request for run 'x'/'m'; this node serves run 'r'/'m'$"):
        ServedRun("r", "m").check(_run("x"))
    with pytest.raises(ProtocolMismatch, match="stage 0; this node serves run 'r'/'m' stage 1"):
        ServedRun("r", "m", stage=1).check(_run(), 0)
    with pytest.raises(ProtocolMismatch):
        ServedRun("r", "m", stage=1).check(_run(manifest_hash="other"), 1)


def test_a_request_must_name_the_peer_that_signed_the_call():
    check_caller("anyone", "PairRequest")  # not signed (no proven caller): nothing to compare
    token = CALLER.set("peer-abcdefgh")
    try:
        check_caller("peer-abcdefgh", "PairRequest")
        with pytest.raises(InvalidPayload, match="names peer 'r-012345', but the call is signed by abcdefgh"):
            check_caller("other-012345", "PairRequest")
        with pytest.raises(InvalidPayload, match="the route's last hop names peer ''"):
            check_caller("", "the route's last hop")
    finally:
        CALLER.reset(token)


def test_a_peer_keeps_its_stub_until_the_dialer_replaces_its_channel():
    class Dialer:
        def __init__(self) -> None:
            self.channels = {"a": object(), "b": object()}

        async def channel(self, peer_id):
            return self.channels[peer_id], "direct"

    async def scenario():
        dialer = Dialer()
        stubs = StubCache(dialer, lambda channel: ["stub on", channel])
        first, path = await stubs.get("a")
        assert path == "direct" and first[1] is dialer.channels["a"]
        assert (await stubs.get("a"))[0] is first and (await stubs.get("b"))[0] is not first
        dialer.channels["a"] = object()  # reconnected
        renewed, _ = await stubs.get("a")
        assert renewed is not first and renewed[1] is dialer.channels["a"]
        stubs.clear()
        assert (await stubs.get("a"))[0] is not renewed

    asyncio.run(scenario())


def test_a_refusal_whose_status_grpc_lost_is_busy_and_other_internal_errors_are_not():
    """grpc.aio reports INTERNAL 'Internal error from Core' when the server ends a streaming call
    while the client still writes (grpc/grpc#36066): a node's early refusal, most often busy."""
    empty = grpc.aio.Metadata()
    lost = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, empty, empty, "Internal error from Core")
    other = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, empty, empty, "Exception calling application: boom")
    assert isinstance(error_from_rpc(lost, "peer"), PeerBusy)
    not_busy = error_from_rpc(other, "peer")
    assert isinstance(not_busy, PeerUnavailable) and "INTERNAL" in str(not_busy)
