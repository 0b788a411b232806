"""Tensor codecs for the wire: `none`, `bf16`, `int8`, `fp8` and `int4` blockwise, `topk`. Pure
torch, no grpc.

A codec turns a tensor into (TensorSpec, payload bytes) and decodes payload bytes into a
preallocated tensor. Receivers validate a spec against their expectations and limits with
`expected_payload_bytes` (codec/spec.py) *before* allocating or reading any payload.

The blockwise codecs cut the flattened tensor into blocks of `block_size` elements (the last one
may be shorter) and send one little-endian float32 scale per block, s = max(absmax / L, 2^-126)
with L the codec's largest code, then the codes; a value decodes to code * s. The floor keeps
x / s from dividing by a denormal or zero. Error bounds are per element, in units of s: so
relative to the block's absmax wherever absmax >= L * 2^-126 (about 1e-36), and below 2^-127
absolute under it. Every finite input whose absmax is at most 2^127 encodes; larger values, like
non-finite ones, are refused (their codes * scales could overflow). Decoders refuse scales that
are non-finite, negative, or above what the largest such absmax (or the dtype's own maximum,
for float16) gives, so every decoded value is finite.

int8 layout (L = 127): ceil(n / block_size) scales, then n int8 values x / s rounded to
nearest. |error| <= s / 2 = absmax / 254.

fp8 layout (L = 448): ceil(n / block_size) scales, then n bytes of float8 e4m3fn (1 sign bit,
4 exponent bits with bias 7, 3 mantissa bits; largest finite 448, no inf; the NaN codes 0x7F and
0xFF are refused when decoding) holding x / s rounded to nearest even. |error| <= max(|x| / 16,
s / 1024): 3 mantissa bits keep a value within 1/16 of itself down to 2^-6 s, and below that
the spacing is 2^-9 s; so at most absmax / 16, and small values next to an outlier keep their
relative precision. It rounds to nearest both ways: its error is relative to each value, so no
component of a gradient is systematically dropped.

int4 layout (L = 7): ceil(n / block_size) scales, then ceil(n / 2) bytes. Each value is
q = x / s rounded to an integer in -7..7, stored as the nibble q + 8 (1..15; nibble 0 is
refused); element 2i in the low nibble of byte i, element 2i + 1 in its high nibble; an odd n
pads the last high nibble with 8 (zero), and any other padding is refused. Rounding is to
nearest, |error| <= s / 2 = absmax / 14, or stochastic (`stochastic=` a torch.Generator):
q = floor(x / s + u) with u uniform in (0, 1) on a grid of 2^-16, |error| < s = absmax / 7 and
E[decoded] = x to within s / 2^16.
Forward activations want nearest (the smaller error, and a deterministic forward). Backward
gradients want stochastic: with a step of absmax / 7, nearest rounding sends every value under
absmax / 14 in a block with an outlier to 0 on every step, a bias that SGD and Adam never
average away, while unbiased rounding only adds variance that the sums over microbatches and
steps average out. The draws come only from the given generator: a seeded one reproduces the
payload exactly.

All bounds hold up to float32 rounding of the quotient x / s and of the product code * s (each
within 2^-24 of itself).

topk_int2, topk_int4 (top-k per chunk, quantized values) and slice (a seeded slice of exact values):
codec/sparse.py.

topk layout (sparse; for outer deltas): `nnz` little-endian int32 indices into the flattened
tensor, strictly increasing, then `nnz` values in the declared dtype. Every other element decodes
to 0. The sender chooses nnz (the largest-|x| fraction, see `topk_count`); the spec declares it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from noloco_node.codec import sparse
from noloco_node.codec.blockwise import (  # noqa: F401 - LEVELS, MIN_SCALE, MAX_ABSMAX: re-exported
    LEVELS,
    MAX_ABSMAX,
    MIN_SCALE,
    decode_blockwise,
    encode_blockwise,
    max_abs,
)
from noloco_node.codec.names import WIRE_CODECS as CODECS
from noloco_node.codec.sizes import BLOCKWISE, CHUNK, DEFAULT_BLOCK, SparseCodecError, per_chunk_count
from noloco_node.codec.spec import (
    DTYPE_NAMES,
    DTYPES,
    FLOAT_DTYPES,
    CodecError,
    TensorSpec,
    expected_payload_bytes,
)

DEFAULT_INT8_BLOCK = DEFAULT_BLOCK


def encode(
    tensor: Tensor,
    codec: str,
    *,
    block_size: int = DEFAULT_BLOCK,
    fraction: float = 0.01,
    stochastic: torch.Generator | None = None,
    dtype: str | None = None,
    slice_key: tuple[int, int, int] | None = None,
    copy: bool = True,
) -> tuple[TensorSpec, bytes | memoryview]:
    """Encode `tensor` (any device) with `codec`; returns its spec and the payload bytes.
    `fraction` is topk's share of elements sent (the largest magnitudes). `stochastic`: int4
    rounds stochastically (unbiased) with draws from this CPU generator; None = to nearest. The
    other codecs ignore it (see the module docstring for why fp8 needs no such rounding).
    `dtype` declares the tensor's logical dtype when it differs from the one handed in: a GPU stage
    hands a bfloat16 copy of float32 activations for the lossy codecs (half the device-to-host
    bytes, and no float32 round trip), which they encode exactly as they would the float32 tensor
    (bf16 rounds to the same bits); `none` and `topk` carry values as they are, so there it must match.
    `slice_key` = (seed, parts, part): which slice the slice codec sends (codec/sparse.py).
    `copy=False`: where the payload is the values' own memory (`none`, and `bf16` of a bfloat16
    CPU tensor), a read-only memoryview over them instead of a copy: for a sender that owns the
    tensor and leaves it unchanged until the payload is sent (a stage's hop)."""
    dtype = _declared_dtype(tensor, codec, dtype)
    flat = tensor.detach().reshape(-1).cpu()
    if codec in ("none", "bf16"):  # the values' own bytes: a view, or its one copy
        view = _bytes_view(flat, codec)
        payload, nnz, spec_block, (seed, parts, part) = (bytes(view) if copy else view), 0, 0, (0, 0, 0)
    else:
        payload, nnz, spec_block, (seed, parts, part) = _encode_flat(
            flat, codec, block_size=block_size, fraction=fraction, stochastic=stochastic, slice_key=slice_key
        )
    spec = TensorSpec(
        dtype=dtype,
        shape=tuple(tensor.shape),
        codec=codec,
        block_size=spec_block,
        payload_bytes=len(payload),
        nnz=nnz,
        slice_seed=seed,
        slice_parts=parts,
        slice_part=part,
    )
    expected_payload_bytes(spec)  # rejects e.g. bf16 of int64
    return spec, payload


def _declared_dtype(tensor: Tensor, codec: str, dtype: str | None) -> str:
    """The dtype the spec declares: the tensor's own, or a float one the lossy codecs encode alike."""
    actual = DTYPE_NAMES.get(tensor.dtype)
    if actual is None:
        raise CodecError(f"cannot encode dtype {tensor.dtype}")
    dtype = dtype or actual
    if dtype != actual and (
        codec in ("none", "topk", "slice") or dtype not in FLOAT_DTYPES or actual not in FLOAT_DTYPES
    ):
        raise CodecError(f"codec {codec!r} cannot send a {actual} tensor as {dtype}")
    return dtype


def _encode_flat(
    flat: Tensor,
    codec: str,
    *,
    block_size: int,
    fraction: float,
    stochastic: torch.Generator | None,
    slice_key: tuple[int, int, int] | None,
) -> tuple[bytes, int, int, tuple[int, int, int]]:
    """The payload of the flattened CPU tensor, with what its spec declares besides: nnz, the block
    size, and the slice's (seed, parts, part) (zeros where the codec has none)."""
    nnz = 0
    spec_block = block_size if codec in BLOCKWISE else 0
    seed = parts = part = 0
    if codec in BLOCKWISE:
        payload = encode_blockwise(flat, codec, block_size, stochastic if codec == "int4" else None)
    elif codec == "topk":
        nnz = topk_count(flat.numel(), fraction)
        payload = _encode_topk(flat, nnz)
    elif codec in sparse.TOPK_LEVELS:
        nnz, spec_block = per_chunk_count(fraction), CHUNK
        values = flat if flat.dtype == torch.float32 else flat.float()
        payload = _sparse(lambda: sparse.encode_chunked_topk(values, codec, nnz, MAX_ABSMAX, MIN_SCALE))
    elif codec == "slice":
        if slice_key is None:
            raise CodecError("the slice codec needs a slice_key (seed, parts, part)")
        seed, parts, part = slice_key
        coordinates = _sparse(lambda: sparse.slice_indices(flat.numel(), parts, part, seed))
        nnz = coordinates.numel()
        payload = _to_bytes(flat[coordinates].contiguous())
    else:
        raise CodecError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    return payload, nnz, spec_block, (seed, parts, part)


def decode_into(spec: TensorSpec, payload: bytes | bytearray | memoryview, out: Tensor) -> Tensor:
    """Decode `payload` into the preallocated `out` (same numel and dtype as the spec)."""
    expected = expected_payload_bytes(spec)
    if len(payload) != expected or spec.payload_bytes not in (0, expected):
        raise CodecError(
            f"payload is {len(payload)} bytes; spec {spec.codec}/{spec.dtype}{list(spec.shape)} needs {expected}"
        )
    if out.numel() != spec.numel or DTYPE_NAMES.get(out.dtype) != spec.dtype:
        raise CodecError(f"output tensor is {out.dtype}{list(out.shape)}, spec says {spec.dtype}{list(spec.shape)}")
    target = out.view(-1)
    if spec.codec == "none":
        target.copy_(_from_bytes(payload, DTYPES[spec.dtype]))
    elif spec.codec == "bf16":
        target.copy_(_from_bytes(payload, torch.int16).view(torch.bfloat16))
    elif spec.codec == "topk":
        _decode_topk(payload, spec, target)
    elif spec.codec in sparse.TOPK_LEVELS:
        max_scale = float(torch.tensor(max_abs(spec.dtype), dtype=torch.float32) / sparse.TOPK_LEVELS[spec.codec])
        _sparse(
            lambda: sparse.decode_chunked_topk(memoryview(payload), spec.codec, spec.numel, spec.nnz, max_scale, target)
        )
    elif spec.codec == "slice":
        _decode_slice(payload, spec, target)
    else:
        decode_blockwise(payload, spec, target)
    return out


def decode(spec: TensorSpec, payload: bytes | bytearray | memoryview) -> Tensor:
    """Decode into a new tensor (allocates spec.numel elements: validate the spec first)."""
    expected_payload_bytes(spec)
    return decode_into(spec, payload, torch.empty(spec.shape, dtype=DTYPES[spec.dtype]))


def _to_bytes(tensor: Tensor) -> bytes:
    return tensor.numpy().tobytes() if tensor.numel() else b""


def _bytes_view(flat: Tensor, codec: str) -> memoryview:
    """The payload of `none` or `bf16` as a read-only view of the values (copied only where the
    values are not already in the wire's dtype, or not contiguous)."""
    wire = flat.contiguous() if codec == "none" else flat.to(torch.bfloat16).contiguous().view(torch.int16)
    if wire.numel() == 0:
        return memoryview(b"")
    return memoryview(wire.numpy()).cast("B").toreadonly()


_from_bytes = sparse.frombuffer


def _sparse(run):
    try:
        return run()
    except SparseCodecError as exc:
        raise CodecError(str(exc)) from None


def _decode_slice(payload: bytes | bytearray | memoryview, spec: TensorSpec, target: Tensor) -> None:
    coordinates = _sparse(lambda: sparse.slice_indices(spec.numel, spec.slice_parts, spec.slice_part, spec.slice_seed))
    if coordinates.numel() != spec.nnz:
        raise CodecError(
            f"slice part {spec.slice_part} of {spec.slice_parts} holds {coordinates.numel()} values, "
            f"the header declares {spec.nnz}"
        )
    target.zero_()
    target[coordinates] = _from_bytes(payload, DTYPES[spec.dtype]).to(target.dtype)


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
    return _to_bytes(indices.to(torch.int32)) + _to_bytes(
        values.view(torch.int16) if values.dtype == torch.bfloat16 else values
    )


def _decode_topk(payload: bytes | bytearray | memoryview, spec: TensorSpec, target: Tensor) -> None:
    k, n = spec.nnz, spec.numel
    view = memoryview(payload)
    indices = _from_bytes(view[: 4 * k], torch.int32).long()
    if k and (indices[0] < 0 or indices[-1] >= n or (k > 1 and not bool((indices[1:] > indices[:-1]).all()))):
        raise CodecError(f"topk indices must be strictly increasing within [0, {n})")
    target.zero_()
    dtype = DTYPES[spec.dtype]
    values = (
        _from_bytes(view[4 * k :], torch.int16).view(dtype)
        if dtype == torch.bfloat16
        else _from_bytes(view[4 * k :], dtype)
    )
    target[indices] = values.to(target.dtype)
