"""Where a received payload lands (codec/host_memory.py): pinned host memory for a stage on a GPU, so
the worker copies it to the device without pinning a copy first; pageable memory otherwise, and
whenever pinning fails. The CUDA cases run in the device call (benchmarks/gpu_call.sh)."""

import logging

import pytest
import torch

from noloco_node.codec import host_memory
from noloco_node.codec.checked import decode_checked, decode_received
from noloco_node.codec.tensors import encode
from noloco_node.pipeline.memory import through_wire
from noloco_node.pipeline.transfers import Transfers
from noloco_node.rpc.tensors import PayloadReceiver, iter_chunks

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback of a machine without CUDA")


def _received(tensor: torch.Tensor, codec: str, *, pinned: bool):
    """`tensor` sent with `codec` and collected chunk by chunk, as the Stage servicer collects it."""
    spec, payload = encode(tensor, codec, dtype="float32")
    receiver = PayloadReceiver(spec, max_bytes=len(payload), pinned=pinned)
    for chunk in iter_chunks(payload, chunk_bytes=1000):
        receiver.add(chunk)
    return spec, receiver.finish()


@pytest.mark.parametrize("codec", ["bf16", "int8", "none"])
def test_a_payload_collected_into_a_uint8_tensor_decodes_as_its_bytes_do(codec):
    tensor = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(1))
    spec, payload = encode(tensor, codec, dtype="float32")
    owner = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    from_bytes, from_tensor = decode_received(spec, bytearray(payload)), decode_received(spec, owner)
    assert from_tensor.dtype == from_bytes.dtype and torch.equal(from_tensor, from_bytes)
    if codec == "bf16":  # a view of the payload itself, no copy
        assert from_tensor.data_ptr() == owner.data_ptr()


@CPU_ONLY
def test_without_cuda_asking_for_pinned_memory_falls_back_to_pageable_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(host_memory, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="noloco_node.codec.host_memory"):
        spec, payload = _received(torch.randn(2, 40, 16), "bf16", pinned=True)
        decoded = decode_checked(*encode(torch.randn(4, 8), "int8"), pinned=True)
    assert isinstance(payload, memoryview) and decoded.shape == (4, 8)
    assert len([r for r in caplog.records if "pinning failed" in r.message]) == 1
    assert decode_received(spec, payload).shape == (2, 40, 16)


@CUDA
@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_on_a_gpu_a_received_hop_lands_pinned_and_reaches_the_device_unchanged(codec):
    tensor = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(2))
    spec, payload = _received(tensor, codec, pinned=True)
    host = decode_received(spec, payload, pinned=True)
    assert host.is_pinned()
    expected = decode_received(spec, bytearray(encode(tensor, codec, dtype="float32")[1]))
    transfers = Transfers(torch.device("cuda"), (torch.float32, torch.float32), (None, None))
    assert torch.equal(transfers.input_to_device(host).cpu(), expected.float())


@CUDA
def test_a_pinned_buffer_is_not_handed_out_again_before_its_copy_to_the_device_is_done():
    """The allocator may reuse a freed pinned block only once the copy that reads it completed: the
    payload is a view of the allocator's own tensor, so it records the copy (a frombuffer alias
    would not be). The stream is held busy so that every copy is still pending when its host
    buffer is dropped and the next payload is received."""
    transfers = Transfers(torch.device("cuda"), (torch.float32, torch.float32), (None, None))
    on_device = []
    for i in range(32):
        torch.cuda._sleep(2_000_000)  # ~1 ms of the stream's time before this copy runs
        _, payload = _received(torch.full((4, 256, 64), float(i)), "bf16", pinned=True)
        spec, _ = encode(torch.zeros(4, 256, 64), "bf16", dtype="float32")
        on_device.append(transfers.input_to_device(decode_received(spec, payload, pinned=True)))
        del payload
    torch.cuda.synchronize()
    assert [float(t.min()) for t in on_device] == [float(i) for i in range(32)]
    assert [float(t.max()) for t in on_device] == [float(i) for i in range(32)]


@CUDA
def test_the_in_memory_twin_hands_a_gpu_stage_pinned_payloads_as_the_servicer_does():
    tensor = torch.randn(2, 40, 16)
    for codec in ("bf16", "int8"):
        _, received, _ = through_wire(tensor, codec, pinned=True)
        assert received.is_pinned()
        _, pageable, _ = through_wire(tensor, codec)
        assert not pageable.is_pinned() and torch.equal(received, pageable)
