"""The last stage's head and loss: whole logits (`F.cross_entropy` on `lm_head(h)`) against the
chunked loss the node runs (model/losses.py), forward and backward, at a real vocabulary.

Each variant runs in a fresh process, so its peak is its own: the peak memory above what the
inputs and the weight hold, their gradients included (host RSS high-water mark on CPU,
max_memory_allocated on a GPU), and the median seconds of a forward and backward. The ratios
compare the two in the same run.

    python benchmarks/head_loss.py                                   # CPU: 1024 tokens, hidden 512, 32k vocab
    python benchmarks/head_loss.py --device cuda --tokens 4096 --hidden 2048 --vocab 128256
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def run_variant(args) -> dict:
    import torch
    import torch.nn.functional as F

    from noloco_node.model.losses import head_cross_entropy
    from noloco_node.runtime.memory import current_memory_bytes, peak_memory_bytes

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device).requires_grad_()
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=g)).to(device).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> float:
        hidden.grad = weight.grad = None
        with autocast:
            if args.variant == "whole":
                loss = F.cross_entropy(F.linear(hidden, weight).float(), labels)
            else:
                loss = head_cross_entropy(hidden, weight, labels)
        loss.backward()
        return float(loss.detach())

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = current_memory_bytes(device)  # the inputs and the weight; their gradients count in the peak
    step()  # warm-up
    times, loss = [], 0.0
    for _ in range(args.repeats):
        started = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return {
        "variant": args.variant,
        "seconds": statistics.median(times),
        "peak_above_inputs": max(0, peak_memory_bytes(device) - baseline),
        "loss": loss,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variant", choices=["whole", "chunked"], help="run one variant in this process")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0
    results = {}
    for variant in ("whole", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--variant", variant], capture_output=True, text=True, timeout=900
        )
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            return out.returncode
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    whole, chunked = results["whole"], results["chunked"]
    print(f"device {args.device}, {args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab}")
    for r in (whole, chunked):
        print(
            f"  {r['variant']:8s} fwd+bwd {r['seconds'] * 1e3:8.1f} ms   peak above inputs "
            f"{r['peak_above_inputs'] / 2**20:8.1f} MiB   loss {r['loss']:.5f}"
        )
    print(
        f"  chunked / whole: time {chunked['seconds'] / whole['seconds']:.2f}, "
        f"peak {chunked['peak_above_inputs'] / max(1, whole['peak_above_inputs']):.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
