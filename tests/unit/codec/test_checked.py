"""The one checked decode: a payload the codec refuses is the sender's InvalidPayload."""

import pytest
import torch

from noloco_node.codec.checked import decode_checked, decode_received
from noloco_node.codec.tensors import encode
from noloco_node.errors import InvalidPayload


@pytest.mark.parametrize("codec", ["none", "bf16", "int8", "topk"])
def test_a_good_payload_decodes_to_a_new_tensor_of_the_spec(codec):
    tensor = torch.randn(4, 64)
    spec, payload = encode(tensor, codec)
    out = decode_checked(spec, payload)
    assert out.shape == tensor.shape and out.dtype == torch.float32
    if codec == "none":
        assert torch.equal(out, tensor)


def test_a_payload_the_codec_refuses_is_invalid_payload():
    spec, payload = encode(torch.randn(8), "none")
    with pytest.raises(InvalidPayload, match="payload is 31 bytes"):
        decode_checked(spec, payload[:-1])


def test_a_received_bf16_hop_stays_bf16_over_the_payload_itself():
    tensor = torch.randn(2, 8, 16)
    spec, payload = encode(tensor, "bf16", dtype="float32")
    buffer = bytearray(payload)  # as the Stage servicer collects it
    out = decode_received(spec, buffer)
    assert out.dtype == torch.bfloat16 and out.shape == tensor.shape
    assert torch.equal(out.float(), decode_checked(spec, payload))  # the same values, widened later
    buffer[0:2] = b"\x00\x00"  # a view, not a copy: no pass over the payload on the event loop
    assert out.view(-1)[0] == 0


def test_a_read_only_bf16_payload_is_copied_so_the_stage_gets_writable_memory():
    spec, payload = encode(torch.randn(4, 4), "bf16", dtype="float32")
    out = decode_received(spec, payload)  # bytes, as the in-memory twin hands it
    out.add_(1)  # would be undefined behaviour over immutable bytes
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_other_received_codecs_decode_as_the_checked_decode_does(codec):
    tensor = torch.randn(4, 64)
    spec, payload = encode(tensor, codec)
    out = decode_received(spec, payload)
    assert out.dtype == torch.float32 and torch.equal(out, decode_checked(spec, payload))


def test_a_short_received_bf16_payload_is_invalid_payload():
    spec, payload = encode(torch.randn(8), "bf16", dtype="float32")
    with pytest.raises(InvalidPayload, match="payload is 15 bytes"):
        decode_received(spec, bytearray(payload[:-1]))
