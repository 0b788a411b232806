"""The spec of one tensor on the wire (dtype, shape, codec and the codec's parameters) and its
validation: a receiver checks a spec against the exact payload length it implies with
`expected_payload_bytes` *before* allocating or reading any payload. The layouts are
codec/tensors.py's and codec/sparse.py's; the arithmetic is codec/sizes.py's. Split from
codec/tensors.py, which exports these names too."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from noloco_node.codec import sparse
from noloco_node.codec.names import WIRE_CODECS as CODECS
from noloco_node.codec.sizes import SparseCodecError, blockwise_payload_bytes, chunked_payload_bytes

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = ("float32", "float64", "bfloat16", "float16")


class CodecError(ValueError):
    """A payload or spec that cannot be decoded; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Everything a receiver needs to validate and preallocate one tensor."""

    dtype: str
    shape: tuple[int, ...]
    codec: str
    block_size: int = 0
    payload_bytes: int = 0
    nnz: int = 0
    """topk: number of (index, value) pairs; topk_int2/4: values kept per chunk; slice: values on
    the slice; 0 for the dense codecs."""
    slice_seed: int = 0
    slice_parts: int = 0
    slice_part: int = 0
    """slice: which slice of the coordinates travels (codec/sparse.py); 0 for the other codecs."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def expected_payload_bytes(spec: TensorSpec) -> int:
    """Exact payload length the spec implies; raises CodecError for an invalid spec."""
    if spec.codec not in CODECS:
        raise CodecError(f"unknown codec {spec.codec!r}; expected one of {', '.join(CODECS)}")
    if spec.dtype not in DTYPES:
        raise CodecError(f"unknown dtype {spec.dtype!r}; expected one of {', '.join(DTYPES)}")
    if any(d < 0 for d in spec.shape):
        raise CodecError(f"negative dimension in shape {spec.shape}")
    n = spec.numel
    if spec.codec == "none":
        return n * DTYPES[spec.dtype].itemsize
    if spec.dtype not in FLOAT_DTYPES:
        raise CodecError(f"codec {spec.codec!r} needs a floating dtype, got {spec.dtype!r}")
    if spec.codec == "bf16":
        return 2 * n
    if spec.codec == "topk":
        if not 0 <= spec.nnz <= n or n >= 2**31:
            raise CodecError(f"topk codec declares {spec.nnz} entries for a tensor of {n}")
        return spec.nnz * (4 + DTYPES[spec.dtype].itemsize)
    if spec.codec in sparse.TOPK_LEVELS:
        try:
            return chunked_payload_bytes(spec.codec, n, spec.nnz, spec.block_size)
        except SparseCodecError as exc:
            raise CodecError(str(exc)) from None
    if spec.codec == "slice":
        if not 0 <= spec.nnz <= n or spec.slice_parts < 1 or spec.slice_part >= spec.slice_parts:
            raise CodecError(
                f"slice declares {spec.nnz} values, part {spec.slice_part} of {spec.slice_parts}, for a tensor of {n}"
            )
        return spec.nnz * DTYPES[spec.dtype].itemsize
    if spec.block_size < 1:
        raise CodecError(f"{spec.codec} codec needs block_size >= 1, got {spec.block_size}")
    return blockwise_payload_bytes(spec.codec, n, spec.block_size)
