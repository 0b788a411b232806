"""The one checked decode of a received payload: allocate from the spec, decode into it, and
report anything the codec refuses as the sender's `InvalidPayload`.

Every receiver of tensors uses it: the Stage servicer (rpc/stage_service.py), the outer exchange
and the state fetch (rpc/outer_service.py, rpc/state_service.py), and their in-memory twins
(sync/memory.py, pipeline/memory.py), so a payload is judged the same way whichever transport
carried it. The spec must be validated first (rpc/tensors.py `header_to_spec`, or the expected
tensor it must match): this allocates `spec.numel` elements.

`decode_received` is what the Stage servicer and its twin hand a stage: the same check, but a
bfloat16 payload of a float32 tensor stays bfloat16, a view of the received bytes. Every bfloat16
value is a float32 value, so nothing changes but where the widening happens: on the stage's
device (pipeline/transfers.py), after a copy of half the bytes, instead of a pass over the payload
and a float32 tensor twice its size on the receiving node's event loop."""

from __future__ import annotations

import torch
from torch import Tensor

from noloco_node.codec.host_memory import host_empty
from noloco_node.codec.spec import expected_payload_bytes
from noloco_node.codec.tensors import DTYPES, CodecError, TensorSpec, decode_into
from noloco_node.errors import InvalidPayload

Bytes = bytes | bytearray | memoryview | Tensor
"""A received payload: its bytes, or the uint8 tensor that holds them (pinned receive buffers)."""


def decode_checked(spec: TensorSpec, payload: Bytes, *, pinned: bool = False) -> Tensor:
    """`payload` decoded into a new tensor of `spec`'s shape and dtype (pinned host memory when
    asked, codec/host_memory.py); raises InvalidPayload when the codec refuses it (wrong length,
    out-of-range sparse indices, bad scales...)."""
    if spec.dtype not in DTYPES:
        raise InvalidPayload(f"unknown dtype {spec.dtype!r}")
    out = host_empty(spec.shape, DTYPES[spec.dtype], pinned=pinned)
    try:
        decode_into(spec, _bytes(payload), out)
    except CodecError as exc:
        raise InvalidPayload(str(exc)) from None
    return out


def decode_received(spec: TensorSpec, payload: Bytes, *, pinned: bool = False) -> Tensor:
    """`payload` as a stage takes it: a `bf16` payload of a float32 tensor as a bfloat16 tensor over
    the payload's own bytes (no copy: hand in a writable buffer the caller will not reuse, or the
    uint8 tensor that holds it), anything else as `decode_checked` decodes it."""
    if spec.codec != "bf16" or spec.dtype != "float32":
        return decode_checked(spec, payload, pinned=pinned)
    try:
        expected = expected_payload_bytes(spec)
    except CodecError as exc:
        raise InvalidPayload(str(exc)) from None
    if len(payload) != expected:
        raise InvalidPayload(f"payload is {len(payload)} bytes; spec bf16/float32{list(spec.shape)} needs {expected}")
    if expected == 0:
        return torch.empty(spec.shape, dtype=torch.bfloat16)
    if isinstance(payload, Tensor):  # a view keeps the tensor's storage, and a pinned one stays pinned
        return payload.view(torch.bfloat16).view(spec.shape)
    if memoryview(payload).readonly:  # the tensor must own writable memory (a stage may write into it)
        payload = bytearray(payload)
    return torch.frombuffer(payload, dtype=torch.bfloat16).view(spec.shape)


def _bytes(payload: Bytes) -> bytes | bytearray | memoryview:
    return memoryview(payload.numpy()) if isinstance(payload, Tensor) else payload
