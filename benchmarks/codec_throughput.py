"""Encode/decode throughput of the wire codecs on a 64 MiB float32 tensor.

Prints GB/s of fp32 input per second for each codec, and the ratio to a baseline measured in
the same run: a plain `dst.copy_(src)` of the same tensor (memory bandwidth on this machine).

    .venv/bin/python benchmarks/codec_throughput.py [--mib 64] [--repeats 5] [--no-tune-allocator]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from noloco_node.wire.codec import decode_into, encode
from noloco_node.runtime.memory import tune_allocator


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-tune-allocator", action="store_true")
    args = parser.parse_args()
    tuned = False if args.no_tune_allocator else tune_allocator()
    numel = args.mib * (1 << 20) // 4
    src = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 0.02
    dst = torch.empty_like(src)
    gigabytes = src.numel() * 4 / 1e9
    baseline = gigabytes / median_seconds(lambda: dst.copy_(src), args.repeats)
    print(f"tensor: {args.mib} MiB float32, threads={torch.get_num_threads()}, allocator tuned={tuned}, repeats={args.repeats}")
    print(f"baseline dst.copy_(src): {baseline:.2f} GB/s")
    print(f"{'codec':<6} {'bytes ratio':>11} {'encode GB/s':>12} {'decode GB/s':>12} {'enc/copy':>9} {'dec/copy':>9} {'rel err':>9}")
    for codec in ("none", "bf16", "int8"):
        spec, payload = encode(src, codec)
        enc = gigabytes / median_seconds(lambda: encode(src, codec), args.repeats)
        dec = gigabytes / median_seconds(lambda: decode_into(spec, payload, dst), args.repeats)
        err = float((dst - src).norm() / src.norm())
        ratio = src.numel() * 4 / len(payload)
        print(f"{codec:<6} {ratio:>11.2f} {enc:>12.2f} {dec:>12.2f} {enc / baseline:>9.3f} {dec / baseline:>9.3f} {err:>9.2e}")


if __name__ == "__main__":
    main()
