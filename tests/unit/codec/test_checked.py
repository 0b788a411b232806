"""The one checked decode: a payload the codec refuses is the sender's InvalidPayload."""

import pytest
import torch

from noloco_node.codec.checked import decode_checked
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
