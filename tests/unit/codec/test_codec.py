"""Codec round trips with bounded error, and malformed input rejected with a clear error."""

import math

import pytest
import torch

from noloco_node.codec.tensors import CodecError, TensorSpec, decode, decode_into, encode, expected_payload_bytes


def weights(n=100_003, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02


def rel_error(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("codec,bound", [("none", 0.0), ("bf16", 4e-3), ("int8", 2e-2)])
def test_round_trip_error_bounds(codec, bound):
    x = weights()
    spec, payload = encode(x, codec)
    assert spec.payload_bytes == len(payload) == expected_payload_bytes(spec)
    out = torch.empty_like(x)
    decode_into(spec, payload, out)
    assert rel_error(out, x) <= bound
    if codec == "none":
        assert torch.equal(out, x)


def test_sizes():
    x = weights(1000)
    assert len(encode(x, "none")[1]) == 4000
    assert len(encode(x, "bf16")[1]) == 2000
    assert len(encode(x, "int8", block_size=64)[1]) == 4 * math.ceil(1000 / 64) + 1000


def test_none_keeps_float64_exactly_and_shapes():
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    spec, payload = encode(x, "none")
    assert spec.dtype == "float64" and spec.shape == (3, 4, 5)
    assert torch.equal(decode(spec, payload), x)


def test_bf16_wire_values_are_bf16_rounding():
    x = torch.randn(257, dtype=torch.float64)
    spec, payload = encode(x, "bf16")
    assert torch.equal(decode(spec, payload), x.to(torch.bfloat16).to(torch.float64))


def test_int8_handles_zero_blocks_and_tails():
    x = torch.zeros(130)
    x[129] = 0.5
    spec, payload = encode(x, "int8", block_size=64)
    torch.testing.assert_close(decode(spec, payload), x, atol=0.5 / 127, rtol=0)


def test_empty_tensor():
    spec, payload = encode(torch.empty(0, 8), "bf16")
    assert payload == b"" and decode(spec, payload).shape == (0, 8)


@pytest.mark.parametrize("codec", ["none", "bf16", "int8"])
def test_wrong_length_rejected(codec):
    spec, payload = encode(weights(1000), codec)
    for bad in (payload[:-1], payload + b"\0"):
        with pytest.raises(CodecError, match="bytes"):
            decode_into(spec, bad, torch.empty(1000))


def test_unknown_codec_and_dtype_rejected():
    with pytest.raises(CodecError, match="unknown dtype"):
        expected_payload_bytes(TensorSpec(dtype="complex32", shape=(4,), codec="none"))
    with pytest.raises(CodecError, match="unknown codec"):
        expected_payload_bytes(TensorSpec(dtype="float32", shape=(4,), codec="zstd"))
    with pytest.raises(CodecError, match="unknown codec"):
        encode(weights(10), "fp4")
    with pytest.raises(CodecError, match="floating dtype"):
        expected_payload_bytes(TensorSpec(dtype="int64", shape=(4,), codec="bf16"))
    with pytest.raises(CodecError, match="negative"):
        expected_payload_bytes(TensorSpec(dtype="float32", shape=(-1, 4), codec="none"))


@pytest.mark.parametrize("bad_scale", [float("nan"), float("inf"), -1.0])
def test_bad_int8_scale_rejected(bad_scale):
    spec, payload = encode(weights(128), "int8", block_size=64)
    corrupted = bytearray(payload)
    corrupted[0:4] = torch.tensor([bad_scale], dtype=torch.float32).numpy().tobytes()
    with pytest.raises(CodecError, match="scale"):
        decode(spec, bytes(corrupted))


def test_output_mismatch_rejected():
    spec, payload = encode(weights(100), "bf16")
    with pytest.raises(CodecError, match="output tensor"):
        decode_into(spec, payload, torch.empty(99))
    with pytest.raises(CodecError, match="output tensor"):
        decode_into(spec, payload, torch.empty(100, dtype=torch.float64))


def test_int8_rejects_non_finite_input():
    x = weights(100)
    x[3] = float("nan")
    with pytest.raises(CodecError, match="non-finite"):
        encode(x, "int8")


# (none carries values as they are: a bfloat16 tensor is no float32 payload for it)
@pytest.mark.parametrize(
    "codec,handed",
    [("none", torch.float32), ("bf16", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.bfloat16)],
)
def test_a_payload_without_a_copy_is_the_same_bytes(codec, handed):
    tensor = torch.randn(3, 70).to(handed)
    spec, payload = encode(tensor, codec, dtype="float32")
    view_spec, view = encode(tensor, codec, dtype="float32", copy=False)
    assert view_spec == spec and bytes(view) == payload and len(view) == len(payload)
    assert torch.equal(decode(view_spec, view), decode(spec, payload))


def test_a_bf16_payload_without_a_copy_is_a_read_only_view_of_a_bf16_tensor():
    tensor = torch.randn(4, 8).to(torch.bfloat16)
    spec, view = encode(tensor, "bf16", dtype="float32", copy=False)
    assert isinstance(view, memoryview) and view.readonly
    tensor[0, 0] = 3.0  # the sender must leave it unchanged until sent: the payload is its memory
    assert decode(spec, view)[0, 0] == 3.0
    assert encode(torch.empty(0), "bf16", copy=False)[1] == b""
