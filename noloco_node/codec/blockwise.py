"""The blockwise codecs, int8, fp8 and int4 (their layouts: codec/tensors.py's docstring). Pure torch.

Encoding runs on whatever device holds the values: on the host when a transport encodes a tensor
(`encode_blockwise`, which refuses what it cannot encode), or on a GPU stage's device before its
result leaves it (`encode_on_device`: no host read, a flag says whether the payload is good), so
the host copies the payload, about a quarter of float32's bytes, and does no codec work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from noloco_node.codec.sparse import frombuffer
from noloco_node.codec.spec import DTYPES, CodecError, TensorSpec, expected_payload_bytes

# Largest code per blockwise codec: a block's scale is its absmax / LEVELS.
LEVELS = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
# The smallest normal float32: a floor on scales, so x / s never divides by a denormal or zero.
MIN_SCALE = 2.0**-126
# The largest block absmax encoded: codes * scales then stay finite in float32.
MAX_ABSMAX = 2.0**127


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor already encoded where it was computed: its spec and its payload, a host uint8 tensor
    (pinned when it came from a GPU). A transport sends it as it is."""

    spec: TensorSpec
    payload: Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    def payload_view(self) -> memoryview:
        """The payload's bytes, without a copy (the sender keeps this object until they are sent)."""
        return memoryview(self.payload.numpy()).toreadonly()


def encode_on_device(tensor: Tensor, codec: str, block_size: int) -> tuple[TensorSpec, Tensor, Tensor]:
    """`tensor`'s float32 values (any float dtype handed in) encoded with a blockwise codec on its
    own device, rounding to nearest: (spec, payload as a uint8 tensor on that device, ok) where ok
    is a boolean tensor there, False when a value was not finite or beyond 2^127 (the payload is
    then meaningless). Nothing here waits for the device; the payload is what `encode_blockwise`
    gives for the same values."""
    if codec not in LEVELS or block_size < 1:
        raise CodecError(f"no blockwise codec {codec!r} with block_size {block_size}")
    flat = tensor.detach().reshape(-1)
    blocks, absmax = _blocks_and_absmax(flat, block_size)
    ok = torch.isfinite(absmax).all() & (absmax <= MAX_ABSMAX).all()
    payload = _payload(blocks, absmax, codec, flat.numel(), None)
    spec = TensorSpec(
        dtype="float32", shape=tuple(tensor.shape), codec=codec, block_size=block_size, payload_bytes=payload.numel()
    )
    expected_payload_bytes(spec)
    return spec, payload, ok


def encode_blockwise(flat: Tensor, codec: str, block_size: int, generator: torch.Generator | None) -> bytes:
    """Scales, then the codes: int8 and fp8 one byte per value, int4 two values per byte; refuses
    non-finite values and values beyond 2^127. Written into one payload buffer, with one float32
    working copy of the values: a hop's encode runs on the sending node's event loop, where every
    pass and temporary counts (benchmarks/hop_host.py)."""
    if block_size < 1:
        raise CodecError(f"{codec} codec needs block_size >= 1, got {block_size}")
    blocks, absmax = _blocks_and_absmax(flat, block_size)
    # NaN and inf propagate into their block's absmax, so one check on it suffices.
    if not torch.isfinite(absmax).all():
        raise CodecError(f"{codec} codec cannot encode non-finite values")
    if (absmax > MAX_ABSMAX).any():
        raise CodecError(f"{codec} codec cannot encode values beyond 2^127 (out of range): {float(absmax.max()):.3g}")
    payload = _payload(blocks, absmax, codec, flat.numel(), generator)
    return payload.cpu().numpy().tobytes() if payload.numel() else b""


def _blocks_and_absmax(flat: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """A float32 working copy of the values in blocks (the last padded with zeros), and each block's
    max |x| (NaN or inf where the block holds one)."""
    n = flat.numel()
    num_blocks = math.ceil(n / block_size)
    values = torch.empty(num_blocks * block_size, dtype=torch.float32, device=flat.device)
    values[:n].copy_(flat)  # widens bf16 without a second temporary (copy_ converts)
    values[n:].zero_()
    blocks = values.view(num_blocks, block_size)
    return blocks, torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())


def _payload(blocks: Tensor, absmax: Tensor, codec: str, n: int, generator: torch.Generator | None) -> Tensor:
    """The payload (uint8, on the blocks' device) from the working copy, which it scales in place."""
    num_blocks = blocks.shape[0]
    levels = LEVELS[codec]
    scales = absmax.div_(levels).clamp_(min=MIN_SCALE)
    scaled = blocks.div_(scales[:, None])
    if codec != "fp8":
        if generator is not None:
            scaled.add_(uniform16(scaled.numel(), generator).to(scaled.device).view_as(scaled)).floor_()
        else:
            scaled.round_()
    # Clamped for fp8 too: the float8 cast's handling of values past 448 is not a documented contract.
    codes = scaled.clamp_(-levels, levels).view(-1)[:n]
    code_bytes = math.ceil(n / 2) if codec == "int4" else n
    payload = torch.empty(4 * num_blocks + code_bytes, dtype=torch.uint8, device=blocks.device)
    payload[: 4 * num_blocks].view(torch.float32).copy_(scales)
    out = payload[4 * num_blocks :]
    if codec == "fp8":
        out.view(torch.float8_e4m3fn).copy_(codes)
    elif codec == "int4":
        out.copy_(pack_nibbles(codes.to(torch.int8)))
    else:
        out.view(torch.int8).copy_(codes)  # exact: the codes are integers within -127..127
    return payload


def uniform16(numel: int, generator: torch.Generator) -> Tensor:
    """Uniform draws (k + 1/2) / 2^16, k in 0..2^16-1, cut from 64-bit random integers: a quarter of
    torch.rand's generator calls. Stochastic rounding with them is unbiased to within 2^-16 of a step."""
    words = torch.randint(-(2**63), 2**63 - 1, (math.ceil(numel / 4),), dtype=torch.int64, generator=generator)
    return words.view(torch.int16)[:numel].float().add_(32768.5).mul_(2.0**-16)


def pack_nibbles(q: Tensor) -> Tensor:
    nibbles = q.to(torch.uint8).add_(8)  # -7..7 -> 1..15
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8, device=nibbles.device)])
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: Tensor, n: int) -> Tensor:
    """Validated int4 codes as int8 in -7..7."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)
    if (nibbles == 0).any():
        raise CodecError("int4 payload holds nibble 0 (-8), outside the codec's -7..7")
    if nibbles.numel() > n and int(nibbles[n]) != 8:
        raise CodecError("int4 payload's padding nibble must encode 0 (8)")
    return nibbles[:n].view(torch.int8).sub_(8)


# fp8 decodes by one gather per byte (3x faster than torch's float8 cast); NaN codes stay NaN.
_FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def decode_blockwise(payload: bytes | bytearray | memoryview, spec: TensorSpec, target: Tensor) -> None:
    n, block = spec.numel, spec.block_size
    num_blocks = math.ceil(n / block)
    view = memoryview(payload)
    scales = frombuffer(view[: 4 * num_blocks], torch.float32)
    # In float32 arithmetic, as the encoder divides: its largest absmax gives exactly this scale.
    max_scale = torch.tensor(max_abs(spec.dtype), dtype=torch.float32) / LEVELS[spec.codec]
    if not torch.isfinite(scales).all() or (scales < 0).any() or (scales > max_scale).any():
        raise CodecError(f"{spec.codec} payload has a non-finite, negative or out-of-range scale")
    raw = frombuffer(view[4 * num_blocks :], torch.uint8 if spec.codec != "int8" else torch.int8)
    if spec.codec == "fp8":
        codes = _FP8_TABLE.index_select(0, raw.int())
        if torch.isnan(codes).any():
            raise CodecError("fp8 payload holds a NaN code (0x7F or 0xFF)")
    elif spec.codec == "int4":
        codes = unpack_nibbles(raw, n)
    else:
        codes = raw
    scale_blocks(codes, scales, block, target)


def max_abs(dtype: str) -> float:
    """Largest block absmax a decoder of `dtype` accepts: finite there and in float32."""
    return min(MAX_ABSMAX, torch.finfo(DTYPES[dtype]).max)


def scale_blocks(codes: Tensor, scales: Tensor, block: int, target: Tensor) -> None:
    """target = codes * scales, one scale per `block` consecutive elements."""
    n = target.numel()
    full = (n // block) * block
    target.copy_(codes)  # widen, then scale in place: a mixed int8 x float32 product is ~5x slower
    if full:
        target[:full].view(-1, block).mul_(scales[: n // block, None])
    if full != n:
        target[full:].mul_(scales[-1])
