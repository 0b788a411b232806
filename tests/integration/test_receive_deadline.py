"""Server-side receive deadlines: Forward streams that send a valid header and then nothing, with
no client deadline, one per in-flight slot, are cut at the node's receive deadline (not held until
the client goes away), and a legitimate microbatch sent right after them is accepted."""

import threading
import time

import grpc
import pytest
import torch

from noloco_node.rpc.tensors import encode_tensor, iter_chunks
from noloco_node.transport.credentials import CallSigner
from noloco_node.transport.identity import NodeIdentity
from noloco_node.transport.tls import TLS_NAME, pem_from_record
from noloco_node.wire.v1 import stage_pb2, tensor_pb2

from .conftest import prepare_tokenizer, tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
FORWARD = "/noloco.wire.v1.Stage/Forward"
HIDDEN, SEQ, SLOTS, RECEIVE_S = 32, 16, 8, 3.0


def _forward(run, me: str, sequence: int):
    header, payload = encode_tensor(torch.randn(1, SEQ, HIDDEN) * 0.1, "none")
    fwd = stage_pb2.ForwardHeader(
        run=run,
        microbatch=stage_pb2.MicrobatchId(origin_peer=me, sequence=sequence),
        target_stage=1,
        route=[stage_pb2.Hop(peer_id=me, address="127.0.0.1:9", stage=0)],
        activations=header,
        labels=[1] * SEQ,
    )
    chunks = [stage_pb2.ForwardMessage(chunk=c) for c in iter_chunks(payload, chunk_bytes=512)]
    return stage_pb2.ForwardMessage(header=fwd), chunks


def test_header_only_streams_are_cut_and_a_real_microbatch_follows(tmp_path, make_swarm):
    overrides = tiny_overrides(
        tmp_path, **{"pipeline.num_stages": 2, "pipeline.max_in_flight": SLOTS, "timeouts.receive_s": RECEIVE_S}
    )
    prepare_tokenizer(overrides)
    swarm = make_swarm(overrides)
    node = swarm.start_node(1, 0)
    swarm.wait_ready([node])
    info = node.info
    run = tensor_pb2.RunIdentity(run_id=info["run_id"], manifest_hash=info["manifest_hash"])
    attackers = [NodeIdentity.generate() for _ in range(SLOTS)]
    honest = NodeIdentity.generate()
    release = threading.Event()
    outcomes: dict[int, tuple[str, float]] = {}
    credentials = grpc.ssl_channel_credentials(root_certificates=pem_from_record(info["tls_cert"]))

    with grpc.secure_channel(
        info["address"], credentials, options=[("grpc.ssl_target_name_override", TLS_NAME)]
    ) as channel:
        stub = channel.stream_unary(
            FORWARD,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=stage_pb2.StageAck.FromString,
        )

        def stall(i: int) -> None:
            header, _ = _forward(run, attackers[i].peer_id, i)

            def messages():
                yield header
                release.wait(60)  # then nothing, and no client deadline: only the server can end it

            start = time.monotonic()
            try:
                stub(messages(), metadata=CallSigner(attackers[i]).metadata(FORWARD, info["peer_id"]))
                outcomes[i] = ("OK", time.monotonic() - start)
            except grpc.RpcError as exc:
                outcomes[i] = (exc.code().name, time.monotonic() - start)

        threads = [threading.Thread(target=stall, args=(i,), daemon=True) for i in range(SLOTS)]
        try:
            for t in threads:
                t.start()
            time.sleep(1.0)  # every slot is held now: an honest microbatch is refused as BUSY
            header, chunks = _forward(run, honest.peer_id, 100)
            with pytest.raises(grpc.RpcError) as busy:
                stub(
                    iter([header] + chunks), timeout=10, metadata=CallSigner(honest).metadata(FORWARD, info["peer_id"])
                )
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, busy.value
            for t in threads:
                t.join(timeout=RECEIVE_S + 20)
        finally:
            release.set()
        print(f"\nheader-only streams ended: {sorted(outcomes.values())}")
        assert len(outcomes) == SLOTS
        assert all(code == "DEADLINE_EXCEEDED" for code, _ in outcomes.values()), outcomes
        assert all(RECEIVE_S - 0.5 <= waited <= RECEIVE_S + 5 for _, waited in outcomes.values()), outcomes

        header, chunks = _forward(run, honest.peer_id, 101)
        ack = stub(iter([header] + chunks), timeout=10, metadata=CallSigner(honest).metadata(FORWARD, info["peer_id"]))
        assert ack.bytes_received == SEQ * HIDDEN * 4
