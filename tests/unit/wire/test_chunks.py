"""A payload cut into stream messages (rpc/tensors.py): chunk_messages fills each message's chunk in
place and puts the same bytes on the wire as a TensorChunk handed to the message's constructor;
PayloadReceiver takes them back in order, refusing a gap, an overrun and a short stream."""

import pytest
import torch

from noloco_node.codec.tensors import encode
from noloco_node.errors import InvalidPayload
from noloco_node.rpc.tensors import PayloadReceiver, chunk_messages, encode_tensor, header_to_spec, iter_chunks
from noloco_node.wire.v1 import outer_pb2, stage_pb2


@pytest.mark.parametrize(
    "message_type", [stage_pb2.ForwardMessage, stage_pb2.BackwardMessage, outer_pb2.ExchangeMessage]
)
@pytest.mark.parametrize("size", [0, 1, 1000, 1024, 5000])
def test_chunk_messages_are_the_nested_constructors_bytes(message_type, size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    built = [m.SerializeToString() for m in chunk_messages(message_type, payload, chunk_bytes=1024)]
    nested = [message_type(chunk=c).SerializeToString() for c in iter_chunks(payload, chunk_bytes=1024)]
    assert built == nested and len(built) == -(-size // 1024)


def test_a_view_of_a_stage_result_goes_out_as_its_bytes_and_comes_back_whole():
    result = torch.randn(3, 100).to(torch.bfloat16)  # what a GPU stage hands a bf16 hop
    header, view = encode_tensor(result, "bf16", dtype="float32", copy=False)
    spec = header_to_spec(header)
    receiver = PayloadReceiver(spec, max_bytes=1 << 20)
    for message in chunk_messages(stage_pb2.ForwardMessage, view, chunk_bytes=128):
        receiver.add(stage_pb2.ForwardMessage.FromString(message.SerializeToString()).chunk)
    assert bytes(receiver.finish()) == encode(result, "bf16", dtype="float32")[1]


def test_the_receiver_refuses_a_gap_an_overrun_and_a_short_stream():
    spec = header_to_spec(encode_tensor(torch.zeros(64), "none")[0])
    chunks = list(iter_chunks(bytes(256), chunk_bytes=100))
    receiver = PayloadReceiver(spec, max_bytes=1 << 20)
    with pytest.raises(InvalidPayload, match="chunk 1 arrived where chunk 0"):
        receiver.add(chunks[1])
    receiver.add(chunks[0])
    with pytest.raises(InvalidPayload, match="truncated"):
        receiver.finish()
    receiver.add(chunks[1])
    receiver.add(chunks[2])
    assert receiver.complete
    with pytest.raises(InvalidPayload, match="exceed"):
        receiver.add(type(chunks[0])(index=3, data=b"x"))
