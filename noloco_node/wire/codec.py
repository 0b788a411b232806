"""Tensor codecs for the wire: `none`, `bf16`, `int8` blockwise absmax, `topk`. Pure torch, no grpc.

A codec turns a tensor into (TensorSpec, payload bytes) and decodes payload bytes into a
preallocated tensor. Receivers validate a spec against their expectations and limits with
`expected_payload_bytes` *before* allocating or reading any payload.

int8 layout: ceil(n / block_size) little-endian float32 scales (absmax / 127 per block), then n
int8 values. Zero blocks have scale 0 and decode to 0.

topk layout (sparse; for outer deltas): `nnz` little-endian int32 indices into the flattened
tensor, strictly increasing, then `nnz` values in the declared dtype. Every other element decodes
to 0. The sender chooses nnz (the largest-|x| fraction, see `topk_count`); the spec declares it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

CODECS = ("none", "bf16", "int8", "topk")
DEFAULT_INT8_BLOCK = 64
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
    """topk: number of (index, value) pairs; 0 for the dense codecs."""

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
    if spec.block_size < 1:
        raise CodecError(f"int8 codec needs block_size >= 1, got {spec.block_size}")
    return 4 * math.ceil(n / spec.block_size) + n


def encode(tensor: Tensor, codec: str, *, block_size: int = DEFAULT_INT8_BLOCK,
           fraction: float = 0.01) -> tuple[TensorSpec, bytes]:
    """Encode `tensor` (any device) with `codec`; returns its spec and the payload bytes.
    `fraction` is topk's share of elements sent (the largest magnitudes)."""
    dtype = DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise CodecError(f"cannot encode dtype {tensor.dtype}")
    flat = tensor.detach().reshape(-1).cpu()
    nnz = 0
    if codec == "none":
        payload = _to_bytes(flat.contiguous())
        spec_block = 0
    elif codec == "bf16":
        payload = _to_bytes(flat.to(torch.bfloat16).view(torch.int16))
        spec_block = 0
    elif codec == "int8":
        payload = _encode_int8(flat, block_size)
        spec_block = block_size
    elif codec == "topk":
        nnz = topk_count(flat.numel(), fraction)
        payload = _encode_topk(flat, nnz)
        spec_block = 0
    else:
        raise CodecError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    spec = TensorSpec(dtype=dtype, shape=tuple(tensor.shape), codec=codec, block_size=spec_block,
                      payload_bytes=len(payload), nnz=nnz)
    expected_payload_bytes(spec)  # rejects e.g. bf16 of int64
    return spec, payload


def decode_into(spec: TensorSpec, payload: bytes | bytearray | memoryview, out: Tensor) -> Tensor:
    """Decode `payload` into the preallocated `out` (same numel and dtype as the spec)."""
    expected = expected_payload_bytes(spec)
    if len(payload) != expected or spec.payload_bytes not in (0, expected):
        raise CodecError(f"payload is {len(payload)} bytes; spec {spec.codec}/{spec.dtype}{list(spec.shape)} needs {expected}")
    if out.numel() != spec.numel or DTYPE_NAMES.get(out.dtype) != spec.dtype:
        raise CodecError(f"output tensor is {out.dtype}{list(out.shape)}, spec says {spec.dtype}{list(spec.shape)}")
    target = out.view(-1)
    if spec.codec == "none":
        target.copy_(_from_bytes(payload, DTYPES[spec.dtype]))
    elif spec.codec == "bf16":
        target.copy_(_from_bytes(payload, torch.int16).view(torch.bfloat16))
    elif spec.codec == "topk":
        _decode_topk(payload, spec, target)
    else:
        _decode_int8(payload, spec, target)
    return out


def decode(spec: TensorSpec, payload: bytes | bytearray | memoryview) -> Tensor:
    """Decode into a new tensor (allocates spec.numel elements: validate the spec first)."""
    expected_payload_bytes(spec)
    return decode_into(spec, payload, torch.empty(spec.shape, dtype=DTYPES[spec.dtype]))


def _to_bytes(tensor: Tensor) -> bytes:
    return tensor.numpy().tobytes() if tensor.numel() else b""


def _from_bytes(payload: bytes | bytearray | memoryview, dtype: torch.dtype) -> Tensor:
    if len(payload) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # Read-only buffers are fine: the result is copied into `out` before anyone writes.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=dtype)


def _encode_int8(flat: Tensor, block_size: int) -> bytes:
    if block_size < 1:
        raise CodecError(f"int8 codec needs block_size >= 1, got {block_size}")
    values = flat if flat.dtype == torch.float32 else flat.float()
    n = values.numel()
    num_blocks = math.ceil(n / block_size)
    if num_blocks * block_size != n:
        values = torch.nn.functional.pad(values, (0, num_blocks * block_size - n))
    blocks = values.view(num_blocks, block_size)
    scales = blocks.abs().amax(dim=1).div_(127.0)
    # NaN and inf propagate into their block's absmax, so one check on the scales suffices.
    if not torch.isfinite(scales).all():
        raise CodecError("int8 codec cannot encode non-finite values")
    inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
    q = torch.mul(blocks, inverse[:, None]).round_().clamp_(-127, 127).to(torch.int8).view(-1)[:n]
    return _to_bytes(scales) + _to_bytes(q)


def _decode_int8(payload: bytes | bytearray | memoryview, spec: TensorSpec, target: Tensor) -> None:
    n, block = spec.numel, spec.block_size
    num_blocks = math.ceil(n / block)
    view = memoryview(payload)
    scales = _from_bytes(view[: 4 * num_blocks], torch.float32)
    if not torch.isfinite(scales).all() or (scales < 0).any():
        raise CodecError("int8 payload has a non-finite or negative scale")
    q = _from_bytes(view[4 * num_blocks:], torch.int8)
    if num_blocks * block == n:
        torch.mul(q.view(num_blocks, block), scales[:, None], out=target.view(num_blocks, block))
        return
    full = (n // block) * block
    if full:
        torch.mul(q[:full].view(-1, block), scales[: n // block, None], out=target[:full].view(-1, block))
    target[full:].copy_(q[full:].float() * scales[-1])


def topk_count(numel: int, fraction: float) -> int:
    """Entries topk sends for `numel` elements: ceil(fraction * numel), at least 1 unless empty."""
    if not 0.0 < fraction <= 1.0:
        raise CodecError(f"topk fraction must be in (0, 1], got {fraction}")
    return min(numel, max(1, math.ceil(fraction * numel))) if numel else 0


def _encode_topk(flat: Tensor, k: int) -> bytes:
    if flat.numel() >= 2**31:
        raise CodecError(f"topk codec indexes with int32: {flat.numel()} elements are too many")
    if not torch.isfinite(flat).all():
        raise CodecError("topk codec cannot encode non-finite values")
    # Sorted indices make the payload canonical (one encoding per selection) and easy to validate.
    indices = torch.topk(flat.abs(), k, sorted=False).indices.sort().values if k else torch.empty(0, dtype=torch.long)
    values = flat[indices].contiguous()
    return _to_bytes(indices.to(torch.int32)) + _to_bytes(values.view(torch.int16) if values.dtype == torch.bfloat16 else values)


def _decode_topk(payload: bytes | bytearray | memoryview, spec: TensorSpec, target: Tensor) -> None:
    k, n = spec.nnz, spec.numel
    view = memoryview(payload)
    indices = _from_bytes(view[: 4 * k], torch.int32).long()
    if k and (indices[0] < 0 or indices[-1] >= n or (k > 1 and not bool((indices[1:] > indices[:-1]).all()))):
        raise CodecError(f"topk indices must be strictly increasing within [0, {n})")
    target.zero_()
    dtype = DTYPES[spec.dtype]
    values = _from_bytes(view[4 * k:], torch.int16).view(dtype) if dtype == torch.bfloat16 else _from_bytes(view[4 * k:], dtype)
    target[indices] = values.to(target.dtype)
