"""Tensors <-> wire messages: header conversion, chunking, and a receiver that validates the
declared size before allocating and checks chunk order and length while receiving."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from noloco_node.codec.host_memory import receive_buffer
from noloco_node.codec.tensors import CodecError, TensorSpec, encode, expected_payload_bytes
from noloco_node.errors import InvalidPayload
from noloco_node.wire.v1 import tensor_pb2

CHUNK_BYTES = 1 << 20  # 1 MiB: the chunk size gRPC streams moved fastest with on this machine
_CODEC_TO_PB = {
    "none": tensor_pb2.CODEC_NONE,
    "bf16": tensor_pb2.CODEC_BF16,
    "int8": tensor_pb2.CODEC_INT8_BLOCKWISE,
    "topk": tensor_pb2.CODEC_TOPK,
    "fp8": tensor_pb2.CODEC_FP8_E4M3_BLOCKWISE,
    "int4": tensor_pb2.CODEC_INT4_BLOCKWISE,
    "topk_int2": tensor_pb2.CODEC_TOPK_INT2,
    "topk_int4": tensor_pb2.CODEC_TOPK_INT4,
    "slice": tensor_pb2.CODEC_SLICE,
}
_CODEC_FROM_PB = {v: k for k, v in _CODEC_TO_PB.items()}
_DTYPE_TO_PB = {
    "float32": tensor_pb2.DTYPE_FLOAT32,
    "float64": tensor_pb2.DTYPE_FLOAT64,
    "bfloat16": tensor_pb2.DTYPE_BFLOAT16,
    "float16": tensor_pb2.DTYPE_FLOAT16,
    "int64": tensor_pb2.DTYPE_INT64,
}
_DTYPE_FROM_PB = {v: k for k, v in _DTYPE_TO_PB.items()}


def spec_to_header(spec: TensorSpec, name: str = "") -> tensor_pb2.TensorHeader:
    return tensor_pb2.TensorHeader(
        name=name,
        dtype=_DTYPE_TO_PB[spec.dtype],
        shape=list(spec.shape),
        codec=_CODEC_TO_PB[spec.codec],
        block_size=spec.block_size,
        payload_bytes=spec.payload_bytes,
        nnz=spec.nnz,
        slice_seed=spec.slice_seed,
        slice_parts=spec.slice_parts,
        slice_part=spec.slice_part,
    )


def header_to_spec(header: tensor_pb2.TensorHeader) -> TensorSpec:
    """Raises InvalidPayload for an unknown codec or dtype, or an inconsistent payload size."""
    if header.codec not in _CODEC_FROM_PB:
        raise InvalidPayload(f"unknown codec {header.codec}")
    if header.dtype not in _DTYPE_FROM_PB:
        raise InvalidPayload(f"unknown dtype {header.dtype}")
    if len(header.shape) > 8:
        raise InvalidPayload(f"tensor rank {len(header.shape)} is too large")
    spec = TensorSpec(
        dtype=_DTYPE_FROM_PB[header.dtype],
        shape=tuple(int(d) for d in header.shape),
        codec=_CODEC_FROM_PB[header.codec],
        block_size=int(header.block_size),
        payload_bytes=int(header.payload_bytes),
        nnz=int(header.nnz),
        slice_seed=int(header.slice_seed),
        slice_parts=int(header.slice_parts),
        slice_part=int(header.slice_part),
    )
    try:
        expected = expected_payload_bytes(spec)
    except CodecError as exc:
        raise InvalidPayload(str(exc)) from None
    if spec.payload_bytes != expected:
        raise InvalidPayload(
            f"header declares {spec.payload_bytes} payload bytes; {spec.codec}/{spec.dtype}{list(spec.shape)} needs "
            f"{expected}"
        )
    return spec


def encode_tensor(
    tensor: Tensor,
    codec: str,
    name: str = "",
    *,
    stochastic: torch.Generator | None = None,
    dtype: str | None = None,
    copy: bool = True,
) -> tuple[tensor_pb2.TensorHeader, bytes | memoryview]:
    """`stochastic`: int4 rounds stochastically with this generator's draws; `dtype`: the logical
    dtype when a lower-precision copy is handed in; `copy=False`: a view of the values where the
    codec's payload is their own bytes (codec/tensors.py)."""
    spec, payload = encode(tensor, codec, stochastic=stochastic, dtype=dtype, copy=copy)
    return spec_to_header(spec, name), payload


def iter_chunks(payload: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tensor_pb2.TensorChunk]:
    view = memoryview(payload)
    for index, start in enumerate(range(0, len(payload), chunk_bytes)):
        yield tensor_pb2.TensorChunk(index=index, data=bytes(view[start : start + chunk_bytes]))


def chunk_messages(message_type: type, payload: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES) -> Iterator:
    """One `message_type` (a stream message with a `chunk` field) per chunk of `payload`, the chunk
    filled in place: a TensorChunk made first and handed to the message's constructor is copied
    into it once more (upb), a pass over the payload on the sender's event loop."""
    view = memoryview(payload).cast("B")
    for index, start in enumerate(range(0, len(view), chunk_bytes)):
        message = message_type()
        message.chunk.index = index
        message.chunk.data = bytes(view[start : start + chunk_bytes])
        yield message


class PayloadReceiver:
    """Collects the chunks of one tensor into a buffer preallocated from the validated spec."""

    def __init__(self, spec: TensorSpec, *, max_bytes: int, pinned: bool = False) -> None:
        if spec.payload_bytes > max_bytes:
            raise InvalidPayload(
                f"declared payload of {spec.payload_bytes} bytes exceeds this node's limit of {max_bytes}"
            )
        self.spec = spec
        # Uninitialised; pinned for a stage on a GPU (codec/host_memory.py). finish() hands it on
        # only once every byte has been written.
        self.buffer, self.owner = receive_buffer(spec.payload_bytes, pinned=pinned)
        self.received = 0
        self.next_index = 0

    def add(self, chunk: tensor_pb2.TensorChunk) -> None:
        if chunk.index != self.next_index:
            raise InvalidPayload(f"chunk {chunk.index} arrived where chunk {self.next_index} was expected")
        data = chunk.data  # each access to a bytes field copies it: read it once
        end = self.received + len(data)
        if end > len(self.buffer):
            raise InvalidPayload(f"chunks exceed the declared {len(self.buffer)} payload bytes")
        self.buffer[self.received : end] = data
        self.received = end
        self.next_index += 1

    @property
    def complete(self) -> bool:
        return self.received == len(self.buffer)

    def finish(self) -> memoryview | Tensor:
        """The payload: the pinned uint8 tensor that holds it where it was pinned (keep it a tensor:
        codec/host_memory.py says why), else a view of its bytes."""
        if not self.complete:
            raise InvalidPayload(f"stream ended after {self.received} of {len(self.buffer)} payload bytes (truncated)")
        return self.buffer if self.owner is None else self.owner
