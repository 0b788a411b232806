"""One inner step's host cost, against a bare Adam step over the same tensors in the same run.

A stage's inner step is more than Adam: clip the gradients, skip a step whose gradients are not
finite, and check the weights are finite after it (pipeline/worker.py repairs them from the slow
weights if not). On a GPU each host read of a device value drains the device's queue, and each
small kernel costs a launch: the step used to read the gradient norm before Adam (to decide
whether to step) and then one finiteness flag per tensor, stacked and read (two launches per
tensor, about 220 for a 12-layer stage). Now the fused kernel skips a non-finite step on the
device by itself and the weights are checked with one multi-tensor norm, read together with the
gradient norm (optim/inner.py). Three ways, each over the same parameter shapes and gradients:

  adam       the baseline: Adam's step and zero_grad, nothing else
  inner      InnerOptimizer.step as the node runs it
  previous   the step before this change: the norm read, then Adam, then a flag per tensor

Printed per way: the median wall of a step over --repeats, its multiple of the baseline's, the
ops it runs (torch.profiler: aten ops on the CPU; on CUDA also kernel launches), and on CUDA the
host reads (sync debug mode's warnings).

    .venv/bin/python benchmarks/inner_step.py [--preset medium] [--hidden 256] [--layers 12]
        [--device cpu|cuda] [--repeats 21] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings

import torch
from torch import nn

from noloco_node.config.sections import MODEL_PRESETS
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.optim.integrity import all_finite

SCHEDULE = InnerSchedule(lr_max=1e-4, warmup_steps=10, total_steps=1000)


def stage_shapes(hidden: int, intermediate: int, layers: int, vocab: int) -> list[tuple[int, ...]]:
    """A middle-to-last Llama stage's parameter shapes: per layer four attention projections,
    three MLP matrices and two norms; then the final norm and the LM head."""
    per_layer = [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate), (hidden,), (hidden,)]
    return per_layer * layers + [(hidden,), (vocab, hidden)]


def make_params(shapes, device: str) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(device) for s in shapes]
    return params, grads


def previous_step(inner: InnerOptimizer) -> None:
    """The inner step as it was before (8e77036), with the worker's weight check after it."""
    lr = inner.schedule.lr_at(inner.step_count + 1)
    for group in inner.adam.param_groups:
        group["lr"] = lr
    with_grads = [p for p in inner.params if p.grad is not None]
    norm = float(torch.nn.utils.clip_grad_norm_(with_grads, inner.clip_norm))
    if math.isfinite(norm):
        inner.adam.step()
    inner.adam.zero_grad(set_to_none=True)
    inner.step_count += 1
    all_finite(inner.params)


def ways(params) -> dict:
    fused = params[0].is_cuda
    bare = torch.optim.Adam(params, lr=1e-4, fused=fused or None)
    inner = InnerOptimizer(params, SCHEDULE)
    return {
        "adam": lambda: (bare.step(), bare.zero_grad(set_to_none=True)),
        "inner": inner.step,
        "previous": lambda: previous_step(inner),
    }


def with_grads(params, grads, step) -> None:
    for p, g in zip(params, grads):
        p.grad = g
    step()


def timed(params, grads, steps: dict, repeats: int) -> dict[str, float]:
    """Each way's median wall, the ways taking turns within every repeat (this machine drifts)."""
    walls: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            if params[0].is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with_grads(params, grads, step)
            if params[0].is_cuda:
                torch.cuda.synchronize()
            walls[name].append(time.perf_counter() - t0)
    return {name: statistics.median(w) for name, w in walls.items()}


def counted(params, grads, step) -> dict:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if params[0].is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        with_grads(params, grads, step)
    events = prof.events()
    counts = {"aten_ops": sum(1 for e in events if e.name.startswith("aten::"))}
    if params[0].is_cuda:
        counts["kernel_launches"] = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel"))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with_grads(params, grads, step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts["host_reads"] = sum(1 for w in caught if "synchroniz" in str(w.message))
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="medium", choices=sorted(MODEL_PRESETS))
    p.add_argument("--hidden", type=int, help="narrower than the preset's (the tensor count is what matters here)")
    p.add_argument("--layers", type=int, help="layers of the stage (default: half the preset's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    preset_hidden, preset_intermediate, preset_layers, _ = MODEL_PRESETS[args.preset]
    hidden = args.hidden or preset_hidden
    intermediate = preset_intermediate * hidden // preset_hidden
    layers = args.layers or max(1, preset_layers // 2)
    shapes = stage_shapes(hidden, intermediate, layers, 4096)
    params, grads = make_params(shapes, args.device)
    steps = ways(params)
    for step in steps.values():  # warm-up: Adam's state, the allocator, the kernels
        for _ in range(3):
            with_grads(params, grads, step)
    results = {"device": args.device, "tensors": len(shapes), "parameters": sum(math.prod(s) for s in shapes)}
    walls = timed(params, grads, steps, args.repeats)
    baseline = walls["adam"]
    for name, step in steps.items():
        wall = walls[name]
        results[name] = {"ms": wall * 1e3, "x_adam": wall / baseline, **counted(params, grads, step)}
        counts = "  ".join(f"{k} {v}" for k, v in results[name].items() if k not in ("ms", "x_adam"))
        print(f"{name:9s} {wall * 1e3:8.2f} ms  {wall / baseline:5.2f}x adam  {counts}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
