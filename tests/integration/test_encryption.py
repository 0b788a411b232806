"""What a capture of the wire sees: a Forward sent over a node's direct link (TLS, pinned through
its record) carries none of the tensor's bytes in the clear, while the same messages sent to a
plaintext gRPC server (the control) are found in the same capture. The same holds for a relayed
link: a node that serves over libp2p, reached through the bootstrap peer's relay splice."""

import asyncio
import time
from concurrent import futures

import grpc
import pytest
import torch

from noloco_node.rpc.tensors import encode_tensor, iter_chunks
from noloco_node.transport.credentials import CallSigner
from noloco_node.transport.identity import NodeIdentity
from noloco_node.transport.tls import TLS_NAME, pem_from_record
from noloco_node.wire.v1 import stage_pb2, tensor_pb2

from noloco_node.transport.bridge import Libp2pBridge
from noloco_node.transport.dialer import Contact, Dialer

from .capture import LoopbackCapture, capture_unavailable
from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
FORWARD = "/noloco.wire.v1.Stage/Forward"
HIDDEN, SEQ = 32, 16


def _forward_messages(info: dict, me: NodeIdentity, scale: float = 1e-4):
    """A Forward of a known tensor, and byte strings from its payload to look for on the wire."""
    run = tensor_pb2.RunIdentity(run_id=info["run_id"], manifest_hash=info["manifest_hash"])
    tensor = (torch.arange(SEQ * HIDDEN, dtype=torch.float32).reshape(1, SEQ, HIDDEN) * scale) - 0.02
    header, payload = encode_tensor(tensor, "none")
    needles = [payload[i : i + 24] for i in range(0, len(payload) - 24, len(payload) // 8)]
    messages = [
        stage_pb2.ForwardMessage(
            header=stage_pb2.ForwardHeader(
                run=run,
                microbatch=stage_pb2.MicrobatchId(origin_peer=me.peer_id, sequence=1),
                target_stage=1,
                route=[stage_pb2.Hop(peer_id=me.peer_id, address="127.0.0.1:9", stage=0)],
                activations=header,
                labels=[1] * SEQ,
            )
        )
    ] + [stage_pb2.ForwardMessage(chunk=c) for c in iter_chunks(payload, chunk_bytes=1024)]
    return messages, payload, needles


@pytest.mark.skipif(capture_unavailable() is not None, reason=f"no packet capture here: {capture_unavailable()}")
def test_direct_link_carries_no_tensor_bytes_in_the_clear(tmp_path, make_swarm):
    overrides = tiny_overrides(tmp_path, **{"pipeline.num_stages": 2})
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    node = swarm.start_node(1, 0)
    swarm.wait_ready([node])
    info = node.info
    me = NodeIdentity.generate()
    messages, payload, needles = _forward_messages(info, me)
    serialize = lambda m: m.SerializeToString()  # noqa: E731

    control = grpc.server(futures.ThreadPoolExecutor(2))
    received = []
    control.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "noloco.wire.v1.Stage",
                {
                    "Forward": grpc.stream_unary_rpc_method_handler(
                        lambda it, ctx: (received.extend(it), stage_pb2.StageAck())[1],
                        request_deserializer=stage_pb2.ForwardMessage.FromString,
                        response_serializer=stage_pb2.StageAck.SerializeToString,
                    )
                },
            ),
        )
    )
    control_port = control.add_insecure_port("127.0.0.1:0")
    control.start()
    node_port = int(info["address"].rpartition(":")[2])
    try:
        with LoopbackCapture({node_port}) as direct:
            credentials = grpc.ssl_channel_credentials(root_certificates=pem_from_record(info["tls_cert"]))
            with grpc.secure_channel(
                info["address"], credentials, options=[("grpc.ssl_target_name_override", TLS_NAME)]
            ) as channel:
                ack = channel.stream_unary(
                    FORWARD, request_serializer=serialize, response_deserializer=stage_pb2.StageAck.FromString
                )(iter(messages), timeout=10, metadata=CallSigner(me).metadata(FORWARD, info["peer_id"]))
            time.sleep(0.5)
        assert ack.bytes_received == len(payload)
        with LoopbackCapture({control_port}) as plain:
            with grpc.insecure_channel(f"127.0.0.1:{control_port}") as channel:
                channel.stream_unary(
                    FORWARD, request_serializer=serialize, response_deserializer=stage_pb2.StageAck.FromString
                )(iter(messages), timeout=10)
            time.sleep(0.5)
    finally:
        control.stop(0)
    print(
        f"\ncapture: TLS link {direct.segments} segments / {len(direct.payload)} bytes, plaintext control "
        f"{plain.segments} segments / {len(plain.payload)} bytes"
    )
    assert len(received) == len(messages)
    assert plain.contains_any(needles), "the capture must see plaintext tensor bytes (control)"
    assert direct.segments > 0 and len(direct.payload) >= len(payload)
    assert not direct.contains_any(needles), "tensor bytes visible on the TLS link"


@pytest.mark.skipif(capture_unavailable() is not None, reason=f"no packet capture here: {capture_unavailable()}")
def test_relayed_link_carries_no_tensor_bytes_in_the_clear(tmp_path, make_swarm):
    """A node behind NAT (network.reach = libp2p: it serves over libp2p and holds a slot on the
    bootstrap's relay) is called the way another NATed node calls it: TLS pinned to its record,
    through the bootstrap's relay splice. Both legs cross the relay's port; neither shows a byte
    of the tensor."""
    from hivemind.p2p import P2P

    overrides = tiny_overrides(
        tmp_path, **{"pipeline.num_stages": 2, "network.reach": "libp2p", "timeouts.relay_s": 30.0}
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    node = swarm.start_node(1, 0)
    swarm.wait_ready([node])
    info = node.info
    assert info["reach"] in ("holepunched", "relayed") and any("p2p-circuit" in a for a in info["p2p_addrs"]), info
    relay_port = int(swarm.maddr.split("/tcp/")[1].split("/")[0])
    me = NodeIdentity.generate()
    messages, payload, needles = _forward_messages(info, me, scale=3e-4)
    contact = Contact(info["peer_id"], info["address"], info["reach"], info["tls_cert"], tuple(info["p2p_addrs"]))

    async def call_through_relay():
        p2p = await P2P.create(host_maddrs=[], no_listen=True)  # nothing to dial back to: no direct path
        bridge = Libp2pBridge(p2p)

        async def lookup(peer_id: str):
            return contact if peer_id == contact.peer_id else None

        dialer = Dialer(CallSigner(me), lookup=lookup, bridge=bridge)
        try:
            channel, path = await dialer.channel(contact.peer_id)
            forward = channel.stream_unary(
                FORWARD,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=stage_pb2.StageAck.FromString,
            )
            ack = await forward(iter(messages), timeout=30)
            return ack, path, bridge.traffic.as_dict()
        finally:
            await dialer.close()
            await bridge.close()
            await p2p.shutdown()

    with LoopbackCapture({relay_port}) as relayed:
        ack, path, traffic = asyncio.run(call_through_relay())
        time.sleep(0.5)
    print(
        f"\ncapture at the relay's port: {relayed.segments} segments / {len(relayed.payload)} bytes; "
        f"client bytes by path {traffic}"
    )
    assert path == "relayed" and ack.bytes_received == len(payload)
    assert traffic["relayed"]["out"] >= len(payload), traffic
    # Both legs (caller -> relay, relay -> node) ran through the relay's port.
    assert len(relayed.payload) >= 2 * len(payload), len(relayed.payload)
    assert not relayed.contains_any(needles), "tensor bytes visible on the relayed link"
