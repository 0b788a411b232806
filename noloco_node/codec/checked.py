"""The one checked decode of a received payload: allocate from the spec, decode into it, and
report anything the codec refuses as the sender's `InvalidPayload`.

Every receiver of tensors uses it: the Stage servicer (rpc/stage_service.py), the outer exchange
and the state fetch (rpc/outer_service.py, rpc/state_service.py), and their in-memory twins
(sync/memory.py, pipeline/memory.py), so a payload is judged the same way whichever transport
carried it. The spec must be validated first (rpc/tensors.py `header_to_spec`, or the expected
tensor it must match): this allocates `spec.numel` elements."""

from __future__ import annotations

import torch
from torch import Tensor

from noloco_node.codec.tensors import DTYPES, CodecError, TensorSpec, decode_into
from noloco_node.errors import InvalidPayload


def decode_checked(spec: TensorSpec, payload: bytes | bytearray | memoryview) -> Tensor:
    """`payload` decoded into a new tensor of `spec`'s shape and dtype; raises InvalidPayload when
    the codec refuses it (wrong length, out-of-range sparse indices, bad scales...)."""
    if spec.dtype not in DTYPES:
        raise InvalidPayload(f"unknown dtype {spec.dtype!r}")
    out = torch.empty(spec.shape, dtype=DTYPES[spec.dtype])
    try:
        decode_into(spec, payload, out)
    except CodecError as exc:
        raise InvalidPayload(str(exc)) from None
    return out
