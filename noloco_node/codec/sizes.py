"""How many bytes a codec's payload takes, from the layouts codec/tensors.py and codec/sparse.py
describe. Arithmetic only, no torch: `noloco-node plan` and the memory estimate (model/) size the
wire with it without loading torch, and the decoders check payload lengths with it."""

from __future__ import annotations

import math

from noloco_node.codec.names import parse_outer_codec

BLOCKWISE = ("int8", "fp8", "int4")
DEFAULT_BLOCK = 64
CHUNK = 4096
INDEX_BITS = 12  # log2(CHUNK)
TOPK_BITS = {"topk_int2": 2, "topk_int4": 4}


class SparseCodecError(ValueError):
    """A sparse payload or spec that cannot be decoded (codec/tensors.py re-raises it as CodecError)."""


def blockwise_payload_bytes(codec: str, numel: int, block_size: int) -> int:
    """int8, fp8 and int4: one float32 scale per block, then a byte per element (half a byte for int4)."""
    return 4 * math.ceil(numel / block_size) + (math.ceil(numel / 2) if codec == "int4" else numel)


def kept_in_last(numel: int, per_chunk: int) -> int:
    """Values the last chunk keeps: per_chunk when it is whole, its share of them when shorter."""
    rest = numel % CHUNK
    return per_chunk if rest == 0 else math.ceil(per_chunk * rest / CHUNK)


def kept_count(numel: int, per_chunk: int) -> int:
    """Values a chunked top-k keeps of `numel` elements with `per_chunk` per chunk."""
    if numel == 0:
        return 0
    return (math.ceil(numel / CHUNK) - 1) * per_chunk + kept_in_last(numel, per_chunk)


def chunked_payload_bytes(codec: str, numel: int, per_chunk: int, block_size: int) -> int:
    if block_size != CHUNK:
        raise SparseCodecError(f"{codec} chunks are {CHUNK} elements, not {block_size}")
    if not 1 <= per_chunk <= CHUNK:
        raise SparseCodecError(f"{codec} keeps 1 to {CHUNK} values per chunk, not {per_chunk}")
    kept = kept_count(numel, per_chunk)
    return 4 * math.ceil(numel / CHUNK) + 3 * math.ceil(kept / 2) + math.ceil(kept * TOPK_BITS[codec] / 8)


def per_chunk_count(fraction: float) -> int:
    """Values kept per chunk for a top-k fraction: ceil(fraction * CHUNK), at least 1."""
    return max(1, min(CHUNK, math.ceil(fraction * CHUNK)))


def bytes_per_element(codec: str) -> float:
    """Wire bytes per float32 element of a codec as the config writes it (a pipeline codec, or an
    outer one such as topk:0.02+int2 or slice:0.03125), blockwise scales included."""
    n = 1 << 20
    name, fraction = parse_outer_codec(codec) if ":" in codec else (codec, 1.0)
    if name == "topk":
        return 8 * fraction  # int32 index + fp32 value per element sent
    if name == "slice":
        return 4 * fraction  # exact fp32 values on the slice, no index
    if name in TOPK_BITS:
        return chunked_payload_bytes(name, n, per_chunk_count(fraction), CHUNK) / n
    if name in BLOCKWISE:
        return blockwise_payload_bytes(name, n, DEFAULT_BLOCK) / n
    dense = {"none": 4.0, "bf16": 2.0}
    if name not in dense:
        raise ValueError(
            f"unknown codec {codec!r}; expected one of {', '.join((*dense, *BLOCKWISE, *TOPK_BITS))}, topk or slice"
        )
    return dense[name]
