"""The outer exchange's sparse codecs (codec/sparse.py): top-k per chunk with 2- or 4-bit values and
error feedback, the seeded slice of phi, their sizes, and hostile payloads refused."""

import math

import pytest
import torch

from noloco_node.codec import sizes, sparse
from noloco_node.codec.names import parse_outer_codec
from noloco_node.codec.tensors import CodecError, TensorSpec, decode, encode, expected_payload_bytes
from noloco_node.optim.compress import ErrorFeedback, encode_tensor
from noloco_node.sync.ports import ExpectedTensor
from noloco_node.sync.snapshot import slice_key


def _spec(spec: TensorSpec, **changes) -> TensorSpec:
    fields = {f: getattr(spec, f) for f in TensorSpec.__slots__}
    fields.update(changes)
    fields["payload_bytes"] = 0
    return TensorSpec(**fields)


@pytest.mark.parametrize("codec,bound", [("topk_int2", 1.0), ("topk_int4", 0.5)])
@pytest.mark.parametrize("numel", [1, 100, 4096, 4097, 3 * 4096 + 5])
def test_chunked_topk_keeps_each_chunks_largest_within_its_rounding(codec, bound, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    spec, payload = encode(x, codec, fraction=0.02)
    assert spec.nnz == sizes.per_chunk_count(0.02) == 82 and spec.block_size == sparse.CHUNK
    assert len(payload) == expected_payload_bytes(spec) == sizes.chunked_payload_bytes(codec, numel, 82, sparse.CHUNK)
    y = decode(spec, payload)
    for start in range(0, numel, sparse.CHUNK):
        chunk, got = x[start : start + sparse.CHUNK], y[start : start + sparse.CHUNK]
        k = math.ceil(82 * chunk.numel() / sparse.CHUNK)  # a short last chunk keeps its share
        want = torch.topk(chunk.abs(), k).indices
        assert set(torch.nonzero(got).view(-1).tolist()) <= set(want.tolist())
        scale = float(chunk.abs().max()) / sparse.TOPK_LEVELS[codec]
        assert float((got[want] - chunk[want]).abs().max()) <= bound * scale * (1 + 1e-6)


def test_bits_per_kept_value():
    """What an index costs, said in numbers: 12 bits, plus the values' 2 or 4 and a scale per chunk."""
    numel = 1 << 20
    for codec, value_bits in (("topk_int2", 2), ("topk_int4", 4)):
        kept = sparse.kept_count(numel, sizes.per_chunk_count(0.02))
        bits = 8 * sizes.chunked_payload_bytes(codec, numel, sizes.per_chunk_count(0.02), sparse.CHUNK) / kept
        assert 12 + value_bits < bits < 12 + value_bits + 0.5
    plain = 8 * expected_payload_bytes(TensorSpec("float32", (numel,), "topk", nnz=kept)) / kept
    assert plain == 64


def test_error_feedback_loses_nothing_over_rounds():
    """sum(sent) + residual == sum(Delta): the quantization error travels like the dropped values."""
    g = torch.Generator().manual_seed(0)
    feedback, sent, total = (
        ErrorFeedback(),
        torch.zeros(9000, dtype=torch.float64),
        torch.zeros(9000, dtype=torch.float64),
    )
    for _ in range(12):
        delta = torch.randn(9000, generator=g, dtype=torch.float64)
        encoded = encode_tensor(delta, "topk:0.02+int2", feedback.get("w"))
        feedback.commit({"w": encoded.residual})
        sent += encoded.decoded
        total += delta
    torch.testing.assert_close(sent + feedback.get("w"), total, atol=1e-9, rtol=0)
    assert feedback.norm() < float(total.norm())  # the residual stays bounded, it does not pile up


def test_slice_parts_cover_every_coordinate_once_per_cycle_and_change_between_cycles():
    numel, parts = 1000, 4
    for cycle in range(2):
        seen = torch.zeros(numel, dtype=torch.long)
        chosen = []
        for r in range(cycle * parts, (cycle + 1) * parts):
            seed, p, part = slice_key(7, 1, r, "layers.0.w", parts)
            on = sparse.slice_indices(numel, p, part, seed)
            assert torch.equal(on, on.sort().values) and on.numel() > 0
            seen[on] += 1
            chosen.append(on)
        assert torch.equal(seen, torch.ones(numel, dtype=torch.long))
        if cycle == 0:
            first = chosen
    assert not torch.equal(first[0], chosen[0])
    assert slice_key(7, 1, 3, "a", 4) != slice_key(7, 1, 3, "b", 4) != slice_key(8, 1, 3, "a", 4)


def test_slice_values_are_exact_and_nothing_else_travels():
    x = torch.randn(777, dtype=torch.float64)
    spec, payload = encode(x, "slice", slice_key=(123, 3, 2))
    on = sparse.slice_indices(777, 3, 2, 123)
    assert len(payload) == 8 * on.numel() == 8 * spec.nnz
    y = decode(spec, payload)
    assert torch.equal(y[on], x[on]) and int((y != 0).sum()) == on.numel()
    assert parse_outer_codec("slice:0.03").parts == 33 and parse_outer_codec("slice:1.0").parts == 1


def _corrupt_index(payload: bytes, spec: TensorSpec, which: int, value: int) -> bytes:
    """Rewrite kept index `which` (12-bit, two per 3 bytes) to `value`."""
    start = 4 * math.ceil(spec.numel / sparse.CHUNK) + 3 * (which // 2)
    word = int.from_bytes(payload[start : start + 3], "little")
    shift = 12 * (which % 2)
    word = (word & ~(0xFFF << shift)) | (value << shift)
    return payload[:start] + word.to_bytes(3, "little") + payload[start + 3 :]


def test_hostile_chunked_topk_payloads_are_refused():
    x = torch.randn(4096 + 1000)
    spec, payload = encode(x, "topk_int2", fraction=0.02)
    decode(spec, payload)  # the honest one decodes
    kept_first, kept_last = 82, sparse.kept_in_last(4096 + 1000, 82)
    assert kept_last == 21
    first_index = int(sparse._unpack_indices(torch.frombuffer(bytearray(payload[8:11]), dtype=torch.uint8), 2)[0])  # noqa: SLF001
    with pytest.raises(CodecError, match="strictly increasing"):  # a duplicate index
        decode(spec, _corrupt_index(payload, spec, 1, first_index))
    with pytest.raises(CodecError, match="outside its chunk"):
        decode(spec, _corrupt_index(payload, spec, kept_first + kept_last - 1, 4000))  # the last chunk has 1000
    with pytest.raises(CodecError, match="scale"):
        decode(spec, torch.tensor([float("nan")]).numpy().tobytes() + payload[4:])
    with pytest.raises(CodecError, match="payload is"):
        decode(spec, payload + b"\0")
    with pytest.raises(CodecError, match="keeps 1 to 4096"):
        expected_payload_bytes(_spec(spec, nnz=5000))
    with pytest.raises(CodecError, match="chunks are 4096"):
        expected_payload_bytes(_spec(spec, block_size=64))


def test_a_payload_other_than_the_runs_codec_implies_is_refused_before_decoding():
    """Oversized (more values kept than this run's fraction) and a slice other than this round's."""
    x = torch.randn(5000)
    spec, _ = encode(x, "topk_int2", fraction=0.05)  # a partner keeping 5% where the run says 2%
    want = ExpectedTensor("delta/w", (5000,), "float32", "topk_int2", nnz=sizes.per_chunk_count(0.02))
    assert "sparse values" in want.problem("delta/w", spec, "none")
    mine = slice_key(0, 0, 5, "w", 4)
    spec, _ = encode(x, "slice", slice_key=slice_key(0, 0, 4, "w", 4))
    want = ExpectedTensor("phi/w", (5000,), "float32", "slice", slice_key=mine)
    assert "this round's" in want.problem("phi/w", spec, "none")
    spec, _ = encode(x, "slice", slice_key=mine)
    assert want.problem("phi/w", spec, "none") is None
    with pytest.raises(CodecError, match="holds"):  # a slice header whose count does not match its slice
        decode(_spec(spec, nnz=spec.nnz - 1), bytes(4 * (spec.nnz - 1)))
    with pytest.raises(CodecError, match="part"):
        expected_payload_bytes(_spec(spec, slice_part=4))
