"""Bytes, speed and error of every wire codec on one float32 tensor (64 MiB by default).

For each codec: bytes per element on the wire and how many times fewer than bf16; encode and
decode speed in GB/s of fp32 input, and their ratio to bf16's measured in the same run; the
relative error ||decoded - x|| / ||x||, and the worst element error relative to the absmax of its
64-element block (the unit of the blockwise codecs' documented bounds). A plain `dst.copy_(src)`
of the same tensor is the memory-bandwidth baseline on this machine. int4/sr is int4 with the
stochastic rounding gradients use; topk is the outer delta codec (1% of the elements).

    .venv/bin/python benchmarks/codec_throughput.py [--mib 64] [--repeats 5] [--threads N] [--heavy-tails]
        [--no-tune-allocator]

On a machine shared with other work, --threads 1 gives steadier numbers: a parallel op waits for
its slowest thread, and a busy core stalls every op.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from noloco_node.runtime.memory import tune_allocator
from noloco_node.codec.tensors import decode_into, encode

BLOCK = 64
# (label, codec, encode keyword arguments); the generator is reseeded for every encode.
ROWS = [
    ("none", "none", {}),
    ("bf16", "bf16", {}),
    ("int8", "int8", {}),
    ("fp8", "fp8", {}),
    ("int4", "int4", {}),
    ("int4/sr", "int4", {"stochastic": True}),
    ("topk", "topk", {"fraction": 0.01}),
]


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sample(numel: int, heavy_tails: bool) -> torch.Tensor:
    """Gaussian values at 0.02, or Student-t with 3 degrees of freedom (outliers in most blocks)."""
    generator = torch.Generator().manual_seed(0)
    if not heavy_tails:
        return torch.randn(numel, generator=generator) * 0.02
    normal = torch.randn(numel, generator=generator)
    chi2 = torch.randn(3, numel, generator=generator).pow_(2).sum(0)
    return normal / (chi2 / 3).sqrt_() * 0.02


def worst_block_error(decoded: torch.Tensor, x: torch.Tensor) -> float:
    """max |decoded - x| / absmax over each 64-element block (all-zero blocks excluded)."""
    usable = x.numel() // BLOCK * BLOCK
    err = (decoded[:usable] - x[:usable]).abs().view(-1, BLOCK).amax(dim=1)
    absmax = x[:usable].abs().view(-1, BLOCK).amax(dim=1)
    nonzero = absmax > 0
    return float((err[nonzero] / absmax[nonzero]).max())


def measure(src: torch.Tensor, dst: torch.Tensor, codec: str, kwargs: dict, repeats: int) -> dict[str, float]:
    def run_encode():
        extra = dict(kwargs)
        if extra.pop("stochastic", False):
            extra["stochastic"] = torch.Generator().manual_seed(1)
        return encode(src, codec, **extra)

    spec, payload = run_encode()
    gigabytes = src.numel() * 4 / 1e9
    encode_gbs = gigabytes / median_seconds(run_encode, repeats)
    decode_gbs = gigabytes / median_seconds(lambda: decode_into(spec, payload, dst), repeats)
    return {
        "bytes_per_element": len(payload) / src.numel(),
        "encode": encode_gbs,
        "decode": decode_gbs,
        "rel_error": float((dst - src).norm() / src.norm()),
        "worst_block": worst_block_error(dst, src),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heavy-tails", action="store_true", help="Student-t(3) values instead of Gaussian")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--no-tune-allocator", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tuned = False if args.no_tune_allocator else tune_allocator()
    numel = args.mib * (1 << 20) // 4
    src = sample(numel, args.heavy_tails)
    dst = torch.empty_like(src)
    copy = src.numel() * 4 / 1e9 / median_seconds(lambda: dst.copy_(src), args.repeats)
    print(
        f"tensor: {args.mib} MiB float32 ({'Student-t(3)' if args.heavy_tails else 'Gaussian'} x 0.02), "
        f"threads={torch.get_num_threads()}, allocator tuned={tuned}, repeats={args.repeats}"
    )
    print(f"baseline dst.copy_(src): {copy:.2f} GB/s")
    results = {label: measure(src, dst, codec, kwargs, args.repeats) for label, codec, kwargs in ROWS}
    bf16 = results["bf16"]
    print(
        f"{'codec':<8} {'bytes/elem':>10} {'x fewer':>8} {'enc GB/s':>9} {'dec GB/s':>9} {'enc/bf16':>9} "
        f"{'dec/bf16':>9} {'dec/copy':>9} {'rel err':>9} {'max err/absmax':>15}"
    )
    for label, r in results.items():
        print(
            f"{label:<8} {r['bytes_per_element']:>10.4f} {bf16['bytes_per_element'] / r['bytes_per_element']:>8.2f} "
            f"{r['encode']:>9.2f} {r['decode']:>9.2f} {r['encode'] / bf16['encode']:>9.3f} "
            f"{r['decode'] / bf16['decode']:>9.3f} {r['decode'] / copy:>9.3f} {r['rel_error']:>9.2e} "
            f"{r['worst_block']:>15.2e}"
        )
    print("x fewer: bf16's bytes / this codec's bytes; enc, dec: GB of fp32 input per second")


if __name__ == "__main__":
    main()
