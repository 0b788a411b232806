"""Malformed Forward/Backward calls get the right gRPC status and the node keeps serving. The
client is a peer with its own identity: TLS pinning the node's certificate, every call signed."""

import asyncio
import math
import os

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from noloco_node.rpc.tensors import encode_tensor, iter_chunks
from noloco_node.transport.identity import NodeIdentity
from noloco_node.wire.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

from .clients import aio_secure_channel, secure_channel, signed
from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
HIDDEN, SEQ = 32, 16
FORWARD, BACKWARD = "/noloco.wire.v1.Stage/Forward", "/noloco.wire.v1.Stage/Backward"


def forward_messages(
    run,
    me: str,
    *,
    shape=(1, SEQ, HIDDEN),
    values=None,
    codec="none",
    labels=None,
    truncate=0,
    reorder=False,
    sequence=0,
    payload_bytes=None,
    last_hop=None,
    token_ids=(),
    earlier_hops=0,
):
    """A Forward whose route ends with the caller `me` (the node checks it against the signature),
    or with `last_hop` when given."""
    tensor = values if values is not None else torch.randn(*shape) * 0.1
    header, payload = encode_tensor(tensor, codec)
    if payload_bytes is not None:
        header.payload_bytes = payload_bytes
    b, t = shape[0], shape[1]
    fwd = stage_pb2.ForwardHeader(
        run=run,
        microbatch=stage_pb2.MicrobatchId(origin_peer="tester", sequence=sequence),
        target_stage=1,
        route=[stage_pb2.Hop(peer_id=f"QmHop{i}", address="127.0.0.1:9", stage=0) for i in range(earlier_hops)]
        + [stage_pb2.Hop(peer_id=last_hop or me, address="127.0.0.1:9", stage=0)],
        activations=header,
        labels=labels if labels is not None else [1] * (b * t),
        token_ids=token_ids,
    )
    chunks = list(iter_chunks(payload[: len(payload) - truncate], chunk_bytes=512))
    if reorder and len(chunks) > 1:
        chunks[0], chunks[1] = chunks[1], chunks[0]
    return [stage_pb2.ForwardMessage(header=fwd)] + [stage_pb2.ForwardMessage(chunk=c) for c in chunks]


async def call_forward(info: dict, messages, metadata):
    """A Forward through the sync client, in a thread: grpc.aio's may report INTERNAL when the
    server ends a client-streaming call before the client finished writing (grpc/grpc#36066), which
    the node does when it refuses a header while the payload is still coming (seen in CI on the
    20-chunk "too many sequences" case)."""

    def call():
        with secure_channel(info) as channel:
            forward = channel.stream_unary(
                FORWARD,
                request_serializer=stage_pb2.ForwardMessage.SerializeToString,
                response_deserializer=stage_pb2.StageAck.FromString,
            )
            try:
                forward(iter(messages), timeout=10, metadata=metadata)
                return grpc.StatusCode.OK
            except grpc.RpcError as exc:
                return exc.code()

    return await asyncio.to_thread(call)


def test_malformed_forwards_are_rejected_and_node_keeps_serving(tmp_path, make_swarm):
    # One client sends every bad case: the ban it would earn (tested in test_hostile_input) is off here.
    overrides = tiny_overrides(
        tmp_path, **{"pipeline.num_stages": 2, "security.ban_after_invalid": 1000, "security.ban_after_poisoned": 1000}
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    node = swarm.start_node(1, 0)
    swarm.wait_ready([node])
    run = tensor_pb2.RunIdentity(run_id=node.info["run_id"], manifest_hash=node.info["manifest_hash"])

    me = NodeIdentity.generate()
    info = node.info

    def sig(method=FORWARD):
        return signed(me, method, info)  # a fresh one-time token for each call

    async def scenario():
        async with aio_secure_channel(info) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            fwd = lambda *a, **k: forward_messages(*a, me.peer_id, **k)  # noqa: E731
            results = {
                "other run": await call_forward(
                    info, fwd(tensor_pb2.RunIdentity(run_id="x", manifest_hash="y")), sig()
                ),
                "wrong hidden size": await call_forward(info, fwd(run, shape=(1, SEQ, HIDDEN - 1)), sig()),
                "too many sequences": await call_forward(info, fwd(run, shape=(5, SEQ, HIDDEN)), sig()),
                "truncated stream": await call_forward(info, fwd(run, truncate=100), sig()),
                "chunks reordered": await call_forward(info, fwd(run, reorder=True), sig()),
                "declared size wrong": await call_forward(info, fwd(run, payload_bytes=10), sig()),
                "nan payload": await call_forward(info, fwd(run, values=torch.full((1, SEQ, HIDDEN), math.nan)), sig()),
                "labels outside vocab": await call_forward(info, fwd(run, labels=[10**6] * SEQ), sig()),
                "wrong label count": await call_forward(info, fwd(run, labels=[1] * 3), sig()),
                "token ids to a dense model": await call_forward(info, fwd(run, token_ids=[1] * SEQ), sig()),
                "oversize header": await call_forward(info, fwd(run, labels=[1] * (9 << 20)), sig()),
                "header missing": await call_forward(info, fwd(run)[1:], sig()),
                # A 2-stage pipeline's forward has one hop, stage 0's (the audit's was ~0.9 MB).
                "9999-hop route": await call_forward(info, fwd(run, earlier_hops=9998, sequence=5), sig()),
                # A route whose last hop is not the peer that signed the call (an impersonation).
                "route names another peer": await call_forward(
                    info, fwd(run, last_hop=info["peer_id"], sequence=3), sig()
                ),
            }
            garbage = channel.stream_unary(
                FORWARD, request_serializer=lambda b: b, response_deserializer=stage_pb2.StageAck.FromString
            )
            try:
                await garbage(iter([os.urandom(64), b"\xff" * 32]), timeout=10, metadata=sig())
                results["garbage bytes"] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                results["garbage bytes"] = exc.code()
            backward = stage_pb2.BackwardMessage(
                header=stage_pb2.BackwardHeader(
                    run=run,
                    microbatch=stage_pb2.MicrobatchId(origin_peer="tester", sequence=99),
                    target_stage=1,
                    grad=encode_tensor(torch.zeros(1, SEQ, HIDDEN), "none")[0],
                )
            )
            try:
                await stub.Backward(iter([backward]), timeout=10, metadata=sig(BACKWARD))
                results["backward unknown microbatch"] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                results["backward unknown microbatch"] = exc.code()
            results["valid"] = await call_forward(info, fwd(run, codec="bf16", sequence=1), sig())
            results["valid again"] = await call_forward(info, fwd(run, sequence=2), sig())
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            for method in ("Check", "Watch"):  # health is open (unsigned), and must answer garbage as the others do
                kind = channel.unary_unary if method == "Check" else channel.unary_stream
                call = kind(
                    f"/grpc.health.v1.Health/{method}",
                    request_serializer=lambda b: b,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString,
                )
                try:
                    reply = call(b"\xff" * 16, timeout=5)
                    if method == "Watch":
                        reply = [r async for r in reply]
                    else:
                        await reply
                    results[f"health {method} garbage"] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    results[f"health {method} garbage"] = exc.code()
        # Unsigned: refused before any servicer code runs (a refusing interceptor: call_forward's
        # sync client, for the reason it gives).
        results["unsigned"] = await call_forward(info, forward_messages(run, me.peer_id, sequence=4), None)
        # The public port speaks TLS only: a plaintext client fails at the handshake.
        async with grpc.aio.insecure_channel(info["address"]) as plain:
            try:
                await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                results["plaintext"] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                results["plaintext"] = exc.code()
        return results, health.status

    results, health = asyncio.run(scenario())
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert results == {
        "other run": grpc.StatusCode.FAILED_PRECONDITION,
        "wrong hidden size": invalid,
        "too many sequences": invalid,
        "truncated stream": invalid,
        "chunks reordered": invalid,
        "declared size wrong": invalid,
        "nan payload": invalid,
        "labels outside vocab": invalid,
        "wrong label count": invalid,
        "token ids to a dense model": invalid,
        "oversize header": grpc.StatusCode.RESOURCE_EXHAUSTED,
        "header missing": invalid,
        "9999-hop route": invalid,
        "garbage bytes": invalid,
        "backward unknown microbatch": grpc.StatusCode.FAILED_PRECONDITION,
        "valid": grpc.StatusCode.OK,
        "valid again": grpc.StatusCode.OK,
        "route names another peer": invalid,
        "unsigned": grpc.StatusCode.UNAUTHENTICATED,
        "plaintext": grpc.StatusCode.UNAVAILABLE,
        "health Check garbage": invalid,
        "health Watch garbage": invalid,
    }
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert node.proc.poll() is None, "the node must survive every malformed call"
    swarm.stop()
    [stats] = swarm.node_stats().values()
    assert stats["rejected"]["INVALID_ARGUMENT"] >= 10 and stats["saved_inputs"] == 0
    assert stats["rejected"]["RESOURCE_EXHAUSTED"] == 1  # the oversize header, refused by our servicer
    # Keyed by the route's last hop, which the node now requires to be the proven caller.
    assert stats["forwards_received"] == {me.peer_id: 2}
    assert stats["admission"]["refused"] == {"UNAUTHENTICATED": 1}  # the unsigned call, before any servicer code


def test_hostile_coordinate_payloads_are_refused_by_a_subspace_stage(tmp_path, make_swarm):
    """A residual-subspace stage takes [batch, seq, k] coordinates and the token ids; anything else
    is INVALID_ARGUMENT, and a well-formed coordinate payload is accepted."""
    rank = 4
    overrides = tiny_overrides(
        tmp_path,
        **{
            "pipeline.num_stages": 2,
            "model.residual_subspace": rank,
            "security.ban_after_invalid": 1000,
            "security.ban_after_poisoned": 1000,
        },
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    node = swarm.start_node(1, 0)
    swarm.wait_ready([node])
    run = tensor_pb2.RunIdentity(run_id=node.info["run_id"], manifest_hash=node.info["manifest_hash"])
    me, info = NodeIdentity.generate(), node.info
    ids = [3] * SEQ

    async def scenario():
        fwd = lambda *a, **k: forward_messages(*a, me.peer_id, **k)  # noqa: E731
        sig = lambda: signed(me, FORWARD, info)  # noqa: E731
        return {
            "hidden-wide activations": await call_forward(info, fwd(run, token_ids=ids), sig()),
            "wrong k": await call_forward(info, fwd(run, shape=(1, SEQ, rank + 1), token_ids=ids), sig()),
            "no token ids": await call_forward(info, fwd(run, shape=(1, SEQ, rank)), sig()),
            "token ids outside vocab": await call_forward(
                info, fwd(run, shape=(1, SEQ, rank), token_ids=[10**6] * SEQ), sig()
            ),
            "wrong token id count": await call_forward(info, fwd(run, shape=(1, SEQ, rank), token_ids=[1] * 3), sig()),
            "nan coordinates": await call_forward(
                info,
                fwd(run, shape=(1, SEQ, rank), token_ids=ids, values=torch.full((1, SEQ, rank), math.nan)),
                sig(),
            ),
            "oversized": await call_forward(info, fwd(run, shape=(3, SEQ, rank), token_ids=ids * 3), sig()),
            "valid": await call_forward(
                info, fwd(run, shape=(1, SEQ, rank), token_ids=ids, codec="int8", sequence=1), sig()
            ),
        }

    results = asyncio.run(scenario())
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert results == {
        "hidden-wide activations": invalid,
        "wrong k": invalid,
        "no token ids": invalid,
        "token ids outside vocab": invalid,
        "wrong token id count": invalid,
        "nan coordinates": invalid,
        "oversized": invalid,
        "valid": grpc.StatusCode.OK,
    }
    assert node.proc.poll() is None, "the node must survive every hostile payload"
    swarm.stop()
    [stats] = swarm.node_stats().values()
    assert stats["rejected"]["INVALID_ARGUMENT"] >= 7 and stats["forwards_received"] == {me.peer_id: 1}
