"""Sparse codecs of the outer exchange: top-k per chunk with 2- or 4-bit values (outer deltas) and
a seeded slice of exact values (slow weights). Pure torch, no grpc; codec/tensors.py dispatches here,
and codec/sizes.py holds the payload sizes.

topk_int2 / topk_int4 (spec.block_size = CHUNK = 4096 elements per chunk, spec.nnz = k values kept
per chunk; the last chunk, of L < CHUNK elements, keeps ceil(k L / CHUNK), so a small tensor keeps the
same share as a large one). Layout, for n elements in c = ceil(n / CHUNK) chunks and K kept values
in all:
    c float32 scales, one per chunk: s = max(absmax of the kept values / L, 2^-126)
    K indices within their chunk, 12 bits each, two per 3 bytes (i0 | i1 << 12, little-endian;
      an odd K pads the last with 0), strictly increasing within each chunk
    K codes: int2 four per byte (element 4j in the lowest two bits), q in 0..3 decoding to
      (2q - 3) * s (L = 3; no zero: a kept value is one of the chunk's largest); int4 two per byte
      as the int4 codec's nibbles q + 8, q in -7..7 decoding to q * s (L = 7). Padding codes are 0
      (int2) or 8 (int4); anything else is refused.
Per kept value that is 12 + 2 (or 4) bits, plus 32 / k bits of scale: at 2% of 4096 (k = 82),
14.4 bits, against 64 for the plain topk codec's int32 index and float32 value. Values round to
nearest (|error| <= s for int2, s / 2 for int4); the caller keeps the error in its error-feedback
residual, so it is sent in a later round, not lost.

slice (spec.nnz values, spec.slice_seed / slice_parts / slice_part): the flattened tensor is cut
into blocks of SLICE_BLOCK elements (the last may be shorter), the blocks are permuted by a torch
generator seeded with slice_seed, and part p of P takes the blocks at permuted positions p, p + P,
p + 2P, ...; the payload is the values at those coordinates in increasing order, exact in the
declared dtype. The coordinates are derived on both sides from the three numbers; none travels.
Every other element decodes to 0.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from noloco_node.codec.sizes import CHUNK, INDEX_BITS, TOPK_BITS, SparseCodecError, kept_count, kept_in_last

SLICE_BLOCK = 64
TOPK_LEVELS = {"topk_int2": 3.0, "topk_int4": 7.0}


# ---- chunked top-k with quantized values -------------------------------------------------------------
def encode_chunked_topk(flat: Tensor, codec: str, per_chunk: int, max_abs: float, min_scale: float) -> bytes:
    """`flat` float32 on the CPU; returns the payload (layout in the module docstring)."""
    if not torch.isfinite(flat).all():
        raise SparseCodecError(f"{codec} codec cannot encode non-finite values")
    n = flat.numel()
    chunks = math.ceil(n / CHUNK)
    full = n // CHUNK
    blocks = flat[: full * CHUNK].view(full, CHUNK)
    pieces = [(blocks, per_chunk)] if full else []
    if n % CHUNK:
        pieces.append((flat[full * CHUNK :].view(1, -1), kept_in_last(n, per_chunk)))
    indices, values = [], []
    for piece, k in pieces:
        chosen = torch.topk(piece.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
        indices.append(chosen.reshape(-1))
        values.append(piece.gather(1, chosen))
    absmax = torch.cat([v.abs().amax(dim=1) for v in values]) if chunks else torch.empty(0)
    if (absmax > max_abs).any():
        raise SparseCodecError(f"{codec} codec cannot encode values beyond 2^127: {float(absmax.max()):.3g}")
    levels = TOPK_LEVELS[codec]
    scales = (absmax / levels).clamp_(min=min_scale)
    flat_indices = torch.cat(indices) if indices else torch.empty(0, dtype=torch.long)
    # values come in chunk order (the whole chunks, then the short one), one row per chunk
    flat_scaled = (
        torch.cat(
            [
                (v / scales[first : first + v.shape[0], None]).reshape(-1)
                for first, v in zip((0, full) if full else (0,), values)
            ]
        )
        if values
        else torch.empty(0)
    )
    if codec == "topk_int2":
        codes = ((flat_scaled + 3.0) / 2.0).round_().clamp_(0, 3).to(torch.uint8)
        packed_codes = _pack_bits(codes, 2, pad=0)
    else:
        codes = flat_scaled.round_().clamp_(-7, 7).to(torch.int8).to(torch.uint8).add_(8) & 0x0F
        packed_codes = _pack_bits(codes, 4, pad=8)
    return (
        scales.float().numpy().tobytes()
        + _pack_indices(flat_indices).numpy().tobytes()
        + packed_codes.numpy().tobytes()
    )


def decode_chunked_topk(
    payload: memoryview, codec: str, numel: int, per_chunk: int, max_scale: float, target: Tensor
) -> None:
    """Validate and decode into `target` (flat, numel elements)."""
    chunks = math.ceil(numel / CHUNK)
    kept = kept_count(numel, per_chunk)
    index_bytes = 3 * math.ceil(kept / 2)
    scales = frombuffer(payload[: 4 * chunks], torch.float32)
    if not torch.isfinite(scales).all() or (scales < 0).any() or (scales > max_scale).any():
        raise SparseCodecError(f"{codec} payload has a non-finite, negative or out-of-range scale")
    indices = _unpack_indices(frombuffer(payload[4 * chunks : 4 * chunks + index_bytes], torch.uint8), kept)
    counts = torch.full((chunks,), per_chunk, dtype=torch.long)
    if chunks:
        counts[-1] = kept_in_last(numel, per_chunk)
    chunk_of = torch.repeat_interleave(torch.arange(chunks), counts)
    lengths = torch.full((chunks,), CHUNK, dtype=torch.long)
    if chunks:
        lengths[-1] = numel - (chunks - 1) * CHUNK
    if kept and (indices >= lengths[chunk_of]).any():
        raise SparseCodecError(f"{codec} index outside its chunk")
    same_chunk = chunk_of[1:] == chunk_of[:-1]
    if kept > 1 and not bool((indices[1:] > indices[:-1])[same_chunk].all()):
        raise SparseCodecError(
            f"{codec} indices must be strictly increasing within a chunk (a duplicate or out of order)"
        )
    raw = frombuffer(payload[4 * chunks + index_bytes :], torch.uint8)
    bits = TOPK_BITS[codec]
    codes = _unpack_bits(raw, bits, kept, pad=0 if bits == 2 else 8, codec=codec)
    if bits == 2:
        levels = codes.float().mul_(2.0).sub_(3.0)
    else:
        if (codes == 0).any():
            raise SparseCodecError(f"{codec} payload holds nibble 0 (-8), outside -7..7")
        levels = codes.float().sub_(8.0)
    target.zero_()
    positions = chunk_of * CHUNK + indices
    target[positions] = (levels * scales[chunk_of]).to(target.dtype)


def _pack_indices(indices: Tensor) -> Tensor:
    """12-bit values, two per 3 bytes."""
    values = indices.to(torch.int32)
    if values.numel() % 2:
        values = torch.cat([values, torch.zeros(1, dtype=torch.int32)])
    pairs = values.view(-1, 2)
    word = pairs[:, 0] | (pairs[:, 1] << INDEX_BITS)
    return torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=1).to(torch.uint8).view(-1)


def _unpack_indices(raw: Tensor, count: int) -> Tensor:
    triples = raw.view(-1, 3).to(torch.int32)
    word = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
    values = torch.stack([word & 0xFFF, word >> INDEX_BITS], dim=1).view(-1)
    if values.numel() > count and int(values[count]) != 0:
        raise SparseCodecError("padding index must be 0")
    return values[:count].long()


def _pack_bits(codes: Tensor, bits: int, pad: int) -> Tensor:
    per_byte = 8 // bits
    extra = (-codes.numel()) % per_byte
    if extra:
        codes = torch.cat([codes, torch.full((extra,), pad, dtype=torch.uint8)])
    groups = codes.view(-1, per_byte)
    packed = torch.zeros(groups.shape[0], dtype=torch.uint8)
    for j in range(per_byte):
        packed |= groups[:, j] << (bits * j)
    return packed


def _unpack_bits(raw: Tensor, bits: int, count: int, pad: int, codec: str) -> Tensor:
    per_byte, mask = 8 // bits, (1 << bits) - 1
    codes = torch.stack([(raw >> (bits * j)) & mask for j in range(per_byte)], dim=1).view(-1)
    if (codes[count:] != pad).any():
        raise SparseCodecError(f"{codec} padding codes must be {pad}")
    return codes[:count]


# ---- seeded slice ----------------------------------------------------------------------------------
def slice_indices(numel: int, parts: int, part: int, seed: int) -> Tensor:
    """The coordinates of part `part` of `parts` of a tensor of `numel` elements, increasing."""
    if parts < 1 or not 0 <= part < parts:
        raise SparseCodecError(f"slice part {part} of {parts} does not exist")
    if seed < 0 or seed >= 2**63:
        raise SparseCodecError(f"slice seed {seed} is outside [0, 2^63)")
    blocks = math.ceil(numel / SLICE_BLOCK)
    if parts == 1:
        return torch.arange(numel)
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(blocks, generator=generator)[part::parts].sort().values
    coordinates = (chosen[:, None] * SLICE_BLOCK + torch.arange(SLICE_BLOCK)[None, :]).view(-1)
    return coordinates[coordinates < numel]


def frombuffer(payload: bytes | bytearray | memoryview, dtype: torch.dtype) -> Tensor:
    """A tensor over a payload's bytes, without a copy (codec/tensors.py uses it too)."""
    if len(payload) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # Read-only buffers are fine: the result is copied into its target before anyone writes.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=dtype)
