"""Every wire codec has its own stable enum value and maps both ways; a Stage server accepts
whatever codec a sender picked (validation by the header's spec), and StageClient encodes
Backward with its gradient codec, rounding int4 gradients stochastically from its seed."""

import asyncio

import grpc
import pytest
import torch

from noloco_node.codec.blockwise import EncodedTensor, encode_on_device
from noloco_node.errors import InvalidPayload
from noloco_node.rpc.checks import ServedRun
from noloco_node.rpc.stage_service import StageClient, StageCodecs, StageServicer
from noloco_node.rpc.tensors import encode_tensor, header_to_spec, spec_to_header
from noloco_node.codec.tensors import CODECS, decode, encode
from noloco_node.wire.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

# Numbers on the wire are a contract between versions: appended, never renumbered.
WIRE_NUMBERS = {
    "none": 1,
    "bf16": 2,
    "int8": 3,
    "topk": 4,
    "fp8": 5,
    "int4": 6,
    "topk_int2": 7,
    "topk_int4": 8,
    "slice": 9,
}


def test_every_codec_has_its_stable_wire_number_and_maps_both_ways():
    assert set(WIRE_NUMBERS) == set(CODECS)
    assert tensor_pb2.Codec.Name(5) == "CODEC_FP8_E4M3_BLOCKWISE" and tensor_pb2.Codec.Name(6) == "CODEC_INT4_BLOCKWISE"
    x = torch.randn(3, 70)
    for codec in CODECS:
        spec, _ = encode(x, codec, slice_key=(12345, 4, 3) if codec == "slice" else None)
        header = spec_to_header(spec)
        assert header.codec == WIRE_NUMBERS[codec]
        assert header_to_spec(tensor_pb2.TensorHeader.FromString(header.SerializeToString())) == spec


def test_unknown_codec_number_and_inconsistent_size_refused():
    spec, _ = encode(torch.randn(100), "int4")
    header = spec_to_header(spec)
    header.codec = 10
    with pytest.raises(InvalidPayload, match="unknown codec"):
        header_to_spec(header)
    header = spec_to_header(spec)
    header.payload_bytes += 1  # an int4 header that declares int8's size, say
    with pytest.raises(InvalidPayload, match="needs"):
        header_to_spec(header)


class Recorder:
    """A StageHandler that keeps what arrives."""

    def __init__(self) -> None:
        self.received: list[tuple[str, str, torch.Tensor]] = []

    def admit_forward(self, header, spec):
        return ("forward", spec.codec)

    def release_forward(self, ticket):
        pass

    async def accept_forward(self, ticket, activations):
        self.received.append((*ticket, activations))

    def admit_backward(self, header, spec, caller=""):
        return ("backward", spec.codec)

    async def accept_backward(self, ticket, grad):
        self.received.append((*ticket, grad))


class LoopbackDialer:
    def __init__(self, address: str) -> None:
        self.channel_ = grpc.aio.insecure_channel(address)

    async def channel(self, peer_id):
        return self.channel_, "direct"

    def count_sent(self, path, n):
        pass


def send_over_grpc(activation_codec, gradient_codec, activations, grad) -> list:
    """A real StageClient's Forward and Backward into a real StageServicer on 127.0.0.1: what the
    handler received, [(kind, codec, tensor)]."""
    recorder = Recorder()

    async def scenario():
        server = grpc.aio.server()
        stage_pb2_grpc.add_StageServicer_to_server(
            StageServicer(recorder, run=ServedRun("r", "m"), max_payload_bytes=1 << 20), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        dialer = LoopbackDialer(f"127.0.0.1:{port}")
        try:
            client = StageClient(
                run_id="r",
                manifest_hash="m",
                codecs=StageCodecs(activation_codec, gradient_codec, rounding_seed=5),
                timeout_s=10,
                dialer=dialer,
            )
            microbatch = stage_pb2.MicrobatchId(origin_peer="me", sequence=1)
            await client.forward(
                "peer",
                microbatch=microbatch,
                route=[stage_pb2.Hop(peer_id="me", stage=0)],
                target_stage=1,
                activations=activations,
                labels=torch.ones(16, dtype=torch.long),
            )
            await client.backward("peer", microbatch=microbatch, target_stage=0, grad=grad, loss=1.0, num_tokens=16)
        finally:
            await dialer.channel_.close()
            await server.stop(None)

    asyncio.run(scenario())
    return recorder.received


@pytest.mark.parametrize(
    "activation_codec,gradient_codec",
    [("fp8", None), ("int4", None), ("bf16", "int4"), ("int4", "fp8"), ("none", "int8")],
)
def test_server_accepts_any_codec_and_backward_uses_the_gradient_codec(activation_codec, gradient_codec):
    activations = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1)) * 1e-3
    received = send_over_grpc(activation_codec, gradient_codec, activations, grad)
    sent_grad_codec = gradient_codec or activation_codec
    (kind_f, codec_f, got_activations), (kind_b, codec_b, got_grad) = received
    assert (kind_f, codec_f, kind_b, codec_b) == ("forward", activation_codec, "backward", sent_grad_codec)
    # Bit for bit what the codec gives: nearest for activations, the seeded draws for gradients.
    assert torch.equal(got_activations, decode(*encode(activations, activation_codec)))
    expected_grad = decode(*encode(grad, sent_grad_codec, stochastic=torch.Generator().manual_seed(5)))
    assert torch.equal(got_grad, expected_grad)
    if sent_grad_codec == "int4":
        assert not torch.equal(got_grad, decode(*encode(grad, "int4")))  # not rounded to nearest


def test_encode_tensor_passes_the_generator_on():
    x = torch.randn(200)
    _, payload = encode_tensor(x, "int4", stochastic=torch.Generator().manual_seed(3))
    assert payload == encode(x, "int4", stochastic=torch.Generator().manual_seed(3))[1]
    assert payload != encode_tensor(x, "int4")[1]


@pytest.mark.parametrize("activation_codec,gradient_codec", [("int8", "int8"), ("int4", "fp8")])
def test_what_a_stage_encoded_on_its_device_arrives_as_the_clients_own_encoding(activation_codec, gradient_codec):
    activations = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1)) * 1e-3
    encoded = [
        EncodedTensor(*encode_on_device(x, codec, 64)[:2])
        for x, codec in ((activations, activation_codec), (grad, gradient_codec))
    ]
    (_, codec_f, got_activations), (_, codec_b, got_grad) = send_over_grpc(activation_codec, gradient_codec, *encoded)
    assert (codec_f, codec_b) == (activation_codec, gradient_codec)
    assert torch.equal(got_activations, decode(*encode(activations, activation_codec)))
    assert torch.equal(got_grad, decode(*encode(grad, gradient_codec)))
    int8 = EncodedTensor(*encode_on_device(activations, "int8", 64)[:2])
    with pytest.raises(ValueError, match="the stage encoded int8, this link sends fp8"):
        send_over_grpc("fp8", None, int8, grad)  # a misconfigured stage is a bug, not a silent re-encode
