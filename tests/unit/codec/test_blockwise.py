"""The blockwise codecs (int8, fp8, int4): every element within its documented bound at every
scale, the byte layouts as documented, hostile payloads refused, and int4's stochastic rounding
unbiased (and nearest rounding measurably not, so the test can tell them apart)."""

import math

import pytest
import torch

from noloco_node.codec.blockwise import encode_on_device
from noloco_node.codec.tensors import (
    LEVELS,
    MAX_ABSMAX,
    MIN_SCALE,
    CodecError,
    TensorSpec,
    decode,
    decode_into,
    encode,
    expected_payload_bytes,
)

BLOCK = 64
# Float32 rounding of x / s and of code * s: the documented bounds hold up to this much of absmax.
SLACK = 2.0**-21


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample(scale: float, n: int = 1001, seed: int = 0) -> torch.Tensor:
    """Gaussian values times `scale`, with an all-zero block, a block with one 1000x outlier and
    a ragged tail (n is not a multiple of the block)."""
    x = torch.randn(n, generator=seeded(seed), dtype=torch.float64) * scale
    x[BLOCK : 2 * BLOCK] = 0.0
    x[2 * BLOCK + 5] = 1000.0 * scale
    return x.float()


def block_scales(x: torch.Tensor, codec: str) -> torch.Tensor:
    """Each element's block scale s = max(absmax / L, 2^-126), as the module docstring defines it."""
    n = x.numel()
    padded = torch.nn.functional.pad(x.abs(), (0, -n % BLOCK)).view(-1, BLOCK)
    scales = (padded.amax(dim=1) / LEVELS[codec]).clamp(min=MIN_SCALE)
    return scales.repeat_interleave(BLOCK)[:n].double()


def documented_bound(x: torch.Tensor, codec: str, stochastic: bool) -> torch.Tensor:
    """Per-element error bound from the module docstring, plus float32 rounding slack."""
    s = block_scales(x, codec)
    if codec == "fp8":
        bound = torch.maximum(x.double().abs() / 16, s / 1024)
    else:
        bound = s if stochastic else s / 2
    return bound + SLACK * s * LEVELS[codec] + 2.0**-149


CASES = [("int8", False), ("fp8", False), ("int4", False), ("int4", True)]


@pytest.mark.parametrize("codec,stochastic", CASES)
@pytest.mark.parametrize("scale", [1e-40, 1e-30, 1e-3, 1.0, 1e4, 1e30])
def test_every_element_within_its_documented_bound(codec, stochastic, scale):
    x = sample(scale)
    spec, payload = encode(x, codec, stochastic=seeded(1) if stochastic else None)
    assert spec.payload_bytes == len(payload) == expected_payload_bytes(spec) and spec.block_size == BLOCK
    y = decode(spec, payload)
    assert y.dtype == x.dtype and y.shape == x.shape and torch.isfinite(y).all()
    error = (y.double() - x.double()).abs()
    bound = documented_bound(x, codec, stochastic)
    assert (error <= bound).all(), f"worst excess {float((error - bound).max()):.3g}"
    assert (y[BLOCK : 2 * BLOCK] == 0).all()  # a zero block stays exactly zero
    if scale >= 1e-30:  # normal-range scales: the bound relative to the block absmax
        absmax = block_scales(x, codec) * LEVELS[codec]
        limit = {"int8": 1 / 254, "fp8": 1 / 16, "int4": 1 / 7 if stochastic else 1 / 14}[codec]
        assert (error <= absmax * (limit + SLACK)).all()


def test_relative_errors_on_gaussian_values():
    """The whole-tensor error each codec gives on plain Gaussian values (what the benchmark prints)."""
    x = torch.randn(100_003, generator=seeded(2)) * 0.02
    bounds = {"int8": 0.01, "fp8": 0.035, "int4": 0.13}
    for codec, bound in bounds.items():
        y = decode(*encode(x, codec))
        assert float((y - x).norm() / x.norm()) < bound


def test_fp8_small_values_keep_relative_precision_next_to_an_outlier():
    """Where int4 flattens everything below absmax / 14 to 0, fp8 keeps 1/16 of each value."""
    x = torch.full((BLOCK,), 1e-3)
    x[0] = 1.0
    y = decode(*encode(x, "fp8"))
    assert ((y[1:] - x[1:]).abs() <= x[1:] / 16).all() and (y[1:] > 0).all()
    assert (decode(*encode(x, "int4"))[1:] == 0).all()


def test_byte_layouts_as_documented():
    one = torch.tensor([1.0], dtype=torch.float32).numpy().tobytes()
    # fp8: absmax 448 -> scale 1; then e4m3fn bytes: 448 = 0x7E, 1.0 = 0x38, -0.5 = 0xB0.
    spec, payload = encode(torch.tensor([448.0, 1.0, -0.5]), "fp8")
    assert payload == one + bytes([0x7E, 0x38, 0xB0])
    # int4: absmax 7 -> scale 1; nibbles q + 8: [1, -2, 3, 7, 0] -> 9, 6, 11, 15, 8 (+ pad 8), low first.
    spec, payload = encode(torch.tensor([1.0, -2.0, 3.0, 7.0, 0.0]), "int4")
    assert payload == one + bytes([0x69, 0xFB, 0x88])
    assert torch.equal(decode(spec, payload), torch.tensor([1.0, -2.0, 3.0, 7.0, 0.0]))


def test_fp8_decodes_every_finite_code_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    values = finite.view(torch.float8_e4m3fn).float()
    x = torch.cat([torch.tensor([448.0]), values])  # one block's absmax 448: scale exactly 1
    spec, payload = encode(x, "fp8", block_size=x.numel())
    assert torch.equal(decode(spec, payload), x)


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("n,block", [(0, 64), (1, 64), (63, 64), (64, 64), (65, 64), (1001, 1), (1001, 100)])
def test_payload_size_formula(codec, n, block):
    spec, payload = encode(torch.randn(n), codec, block_size=block)
    values = math.ceil(n / 2) if codec == "int4" else n
    assert len(payload) == 4 * math.ceil(n / block) + values == expected_payload_bytes(spec)
    assert decode(spec, payload).shape == (n,)


@pytest.mark.parametrize("codec", ["fp8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_float_dtypes_decode_into_their_own_dtype(codec, dtype):
    x = torch.randn(300, generator=seeded(3), dtype=torch.float64).to(dtype)
    spec, payload = encode(x, codec)
    out = torch.empty(300, dtype=dtype)
    decode_into(spec, payload, out)
    limit = 1 / 16 if codec == "fp8" else 1 / 14
    own_rounding = 2.0**-8  # the decoded value's rounding into bfloat16 (float16 and float64: less)
    assert float((out.double() - x.double()).abs().max()) <= (limit + own_rounding) * float(x.double().abs().max())


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_refused(codec, bad):
    x = torch.randn(200)
    x[131] = bad
    with pytest.raises(CodecError, match="non-finite"):
        encode(x, codec)
    with pytest.raises(CodecError, match="non-finite"):  # float64 beyond float32's range
        encode(torch.tensor([1e300], dtype=torch.float64), codec)


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_out_of_range_input_refused_and_the_limit_itself_encodes(codec):
    at_limit = torch.tensor([MAX_ABSMAX, -MAX_ABSMAX / 3, 1.0])
    y = decode(*encode(at_limit, codec))
    assert torch.isfinite(y).all() and float(y[0]) == pytest.approx(MAX_ABSMAX, rel=1e-6)
    with pytest.raises(CodecError, match="out of range"):
        encode(torch.tensor([MAX_ABSMAX * (1 + 2.0**-20), 1.0]), codec)


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_wrong_length_and_bad_block_size_refused(codec):
    spec, payload = encode(torch.randn(1000), codec)
    for bad in (payload[:-1], payload + b"\0"):
        with pytest.raises(CodecError, match="bytes"):
            decode_into(spec, bad, torch.empty(1000))
    with pytest.raises(CodecError, match="block_size"):
        expected_payload_bytes(TensorSpec(dtype="float32", shape=(10,), codec=codec, block_size=0))
    with pytest.raises(CodecError, match="block_size"):
        encode(torch.randn(10), codec, block_size=0)
    with pytest.raises(CodecError, match="floating dtype"):
        expected_payload_bytes(TensorSpec(dtype="int64", shape=(10,), codec=codec, block_size=64))


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("bad_scale", [math.nan, math.inf, -1.0, 2.0**127])
def test_bad_scale_refused(codec, bad_scale):
    """2^127 as a scale is out of range: codes up to L would decode past float32's maximum."""
    spec, payload = encode(torch.randn(128), codec)
    corrupted = bytearray(payload)
    corrupted[4:8] = torch.tensor([bad_scale], dtype=torch.float32).numpy().tobytes()
    with pytest.raises(CodecError, match="scale"):
        decode(spec, bytes(corrupted))


def test_float16_scale_limit_is_the_dtype_maximum():
    """A scale fine for float32 would decode float16 values to inf: refused for float16."""
    spec, payload = encode(torch.randn(64, dtype=torch.float16), "fp8")
    corrupted = bytearray(payload)
    corrupted[0:4] = torch.tensor([1000.0], dtype=torch.float32).numpy().tobytes()  # 448 * 1000 > 65504
    with pytest.raises(CodecError, match="scale"):
        decode(spec, bytes(corrupted))
    assert torch.isfinite(decode(spec, payload)).all()


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_fp8_nan_codes_refused(code):
    spec, payload = encode(torch.randn(100), "fp8")
    corrupted = bytearray(payload)
    corrupted[4 * 2 + 17] = code
    with pytest.raises(CodecError, match="NaN code"):
        decode(spec, bytes(corrupted))


@pytest.mark.parametrize("byte,why", [(0x90, "nibble 0"), (0x09, "nibble 0")])
def test_int4_minus_eight_refused(byte, why):
    spec, payload = encode(torch.randn(100), "int4")
    corrupted = bytearray(payload)
    corrupted[4 * 2 + 10] = byte
    with pytest.raises(CodecError, match=why):
        decode(spec, bytes(corrupted))


def test_int4_padding_must_encode_zero():
    spec, payload = encode(torch.randn(101), "int4")
    corrupted = bytearray(payload)
    corrupted[-1] = (corrupted[-1] & 0x0F) | 0x90  # the unused high nibble of the last byte
    with pytest.raises(CodecError, match="padding"):
        decode(spec, bytes(corrupted))


def test_stochastic_rounding_is_reproducible_from_its_generator():
    x = torch.randn(1000, generator=seeded(4))
    first = encode(x, "int4", stochastic=seeded(7))[1]
    assert first == encode(x, "int4", stochastic=seeded(7))[1]
    assert first != encode(x, "int4", stochastic=seeded(8))[1]
    assert first != encode(x, "int4")[1]
    assert encode(x, "int4")[1] == encode(x, "int4")[1]  # nearest is deterministic
    # fp8 and int8 round to nearest whatever generator they are given.
    for codec in ("fp8", "int8"):
        assert encode(x, codec, stochastic=seeded(7))[1] == encode(x, codec)[1]


def rounding_z_scores(x: torch.Tensor, draws: int, generator: torch.Generator | None) -> torch.Tensor:
    """(mean of `draws` decodes - x) / its standard error if rounding were unbiased, per element.
    Unbiased stochastic rounding of v = x / s = k + p gives k + 1 with probability p: variance
    p (1 - p) s^2 per draw."""
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(draws):
        total += decode(*encode(x, "int4", stochastic=generator)).double()
    mean = total / draws
    s = block_scales(x, "int4")
    p = torch.frac(x.double().abs() / s)
    std = (p * (1 - p)).sqrt() * s / math.sqrt(draws)
    return (mean - x.double()) / std.clamp(min=1e-30)


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    """A block with an outlier of 1 and small values 0.02..0.12: nearest rounds each small value to
    0 or 1/7 every time; stochastic rounding's mean over draws must come back to each value within
    5.5 standard errors (false failure about 4e-8 per element, 1e-5 over the block)."""
    x = torch.linspace(0.02, 0.12, BLOCK * 4)
    x[::BLOCK] = 1.0  # one outlier per block: s = 1 / 7, every other value between grid points
    draws = 2000
    z = rounding_z_scores(x, draws, seeded(11))
    small = torch.ones_like(x, dtype=torch.bool)
    small[::BLOCK] = False
    assert float(z[small].abs().max()) < 5.5
    assert abs(float(z[small].mean())) < 5.5 / math.sqrt(int(small.sum()))
    # The same statistic on nearest rounding: the bias is many standard errors (the test has power).
    nearest = rounding_z_scores(x, draws, None)
    assert float(nearest[small].abs().median()) > 20


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 63, 64, 1001])
def test_encoding_on_the_device_gives_the_hosts_payload(codec, dtype, n):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    spec, payload, ok = encode_on_device(x.view(1, n), codec, 64)
    host_spec, host_payload = encode(x.view(1, n), codec, dtype="float32")
    assert bool(ok) and spec == host_spec and payload.dtype == torch.uint8
    assert payload.numpy().tobytes() == host_payload


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e38 * 3])
def test_encoding_on_the_device_flags_what_the_host_refuses(bad):
    x = torch.randn(200)
    x[77] = bad
    _, _, ok = encode_on_device(x, "int8", 64)
    assert not bool(ok)
    with pytest.raises(CodecError):
        encode(x, "int8")
