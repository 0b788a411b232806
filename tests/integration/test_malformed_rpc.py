"""Malformed Forward/Backward calls get the right gRPC status and the node keeps serving."""

import asyncio
import math
import os

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from noloco_node.rpc.tensors import encode_tensor, iter_chunks
from noloco_node.wire.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
HIDDEN, SEQ = 32, 16


def forward_messages(run, *, shape=(1, SEQ, HIDDEN), values=None, codec="none", labels=None, truncate=0,
                     reorder=False, sequence=0, payload_bytes=None):
    tensor = values if values is not None else torch.randn(*shape) * 0.1
    header, payload = encode_tensor(tensor, codec)
    if payload_bytes is not None:
        header.payload_bytes = payload_bytes
    b, t = shape[0], shape[1]
    fwd = stage_pb2.ForwardHeader(
        run=run, microbatch=stage_pb2.MicrobatchId(origin_peer="tester", sequence=sequence), target_stage=1,
        route=[stage_pb2.Hop(peer_id="tester", address="127.0.0.1:9", stage=0)], activations=header,
        labels=labels if labels is not None else [1] * (b * t))
    chunks = list(iter_chunks(payload[: len(payload) - truncate], chunk_bytes=512))
    if reorder and len(chunks) > 1:
        chunks[0], chunks[1] = chunks[1], chunks[0]
    return [stage_pb2.ForwardMessage(header=fwd)] + [stage_pb2.ForwardMessage(chunk=c) for c in chunks]


async def call_forward(stub, messages):
    try:
        await stub.Forward(iter(messages), timeout=10)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_malformed_forwards_are_rejected_and_node_keeps_serving(tmp_path, make_swarm):
    # One client sends every bad case: the ban it would earn (tested in test_hostile_input) is off here.
    overrides = tiny_overrides(tmp_path, **{"pipeline.num_stages": 2, "security.ban_after_invalid": 1000})
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    node = swarm.start_node(1, 0)
    swarm.wait_ready([node])
    address, run = node.info["address"], tensor_pb2.RunIdentity(run_id=node.info["run_id"],
                                                                manifest_hash=node.info["manifest_hash"])

    async def scenario():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            results = {
                "other run": await call_forward(stub, forward_messages(tensor_pb2.RunIdentity(run_id="x", manifest_hash="y"))),
                "wrong hidden size": await call_forward(stub, forward_messages(run, shape=(1, SEQ, HIDDEN - 1))),
                "too many sequences": await call_forward(stub, forward_messages(run, shape=(5, SEQ, HIDDEN))),
                "truncated stream": await call_forward(stub, forward_messages(run, truncate=100)),
                "chunks reordered": await call_forward(stub, forward_messages(run, reorder=True)),
                "declared size wrong": await call_forward(stub, forward_messages(run, payload_bytes=10)),
                "nan payload": await call_forward(stub, forward_messages(run, values=torch.full((1, SEQ, HIDDEN), math.nan))),
                "labels outside vocab": await call_forward(stub, forward_messages(run, labels=[10**6] * SEQ)),
                "wrong label count": await call_forward(stub, forward_messages(run, labels=[1] * 3)),
                "oversize header": await call_forward(stub, forward_messages(run, labels=[1] * (9 << 20))),
                "header missing": await call_forward(stub, forward_messages(run)[1:]),
            }
            garbage = channel.stream_unary("/noloco.wire.v1.Stage/Forward", request_serializer=lambda b: b,
                                           response_deserializer=stage_pb2.StageAck.FromString)
            try:
                await garbage(iter([os.urandom(64), b"\xff" * 32]), timeout=10)
                results["garbage bytes"] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                results["garbage bytes"] = exc.code()
            backward = stage_pb2.BackwardMessage(header=stage_pb2.BackwardHeader(
                run=run, microbatch=stage_pb2.MicrobatchId(origin_peer="tester", sequence=99), target_stage=1,
                grad=encode_tensor(torch.zeros(1, SEQ, HIDDEN), "none")[0]))
            try:
                await stub.Backward(iter([backward]), timeout=10)
                results["backward unknown microbatch"] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                results["backward unknown microbatch"] = exc.code()
            results["valid"] = await call_forward(stub, forward_messages(run, codec="bf16", sequence=1))
            results["valid again"] = await call_forward(stub, forward_messages(run, sequence=2))
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            return results, health.status

    results, health = asyncio.run(scenario())
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert results == {
        "other run": grpc.StatusCode.FAILED_PRECONDITION, "wrong hidden size": invalid, "too many sequences": invalid,
        "truncated stream": invalid, "chunks reordered": invalid, "declared size wrong": invalid, "nan payload": invalid,
        "labels outside vocab": invalid, "wrong label count": invalid,
        "oversize header": grpc.StatusCode.RESOURCE_EXHAUSTED, "header missing": invalid, "garbage bytes": invalid,
        "backward unknown microbatch": grpc.StatusCode.FAILED_PRECONDITION, "valid": grpc.StatusCode.OK,
        "valid again": grpc.StatusCode.OK,
    }
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert node.proc.poll() is None, "the node must survive every malformed call"
    swarm.stop()
    [stats] = swarm.node_stats().values()
    assert stats["rejected"]["INVALID_ARGUMENT"] >= 10 and stats["saved_inputs"] == 0
    assert stats["rejected"]["RESOURCE_EXHAUSTED"] == 1  # the oversize header, refused by our servicer
    assert stats["forwards_received"] == {"tester": 2}
