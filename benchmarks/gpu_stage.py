"""A pipeline stage on a GPU against a plain Hugging Face loop of the same model, same data, same
batch, in one run (the ratio is the figure; where torch sees no CUDA device this says so and exits 0).

  plain HF        LlamaForCausalLM (SDPA), fp32 weights, bf16 autocast, fused AdamW, accumulation
  in-process P=2  the node's own parts (node/in_process.py: workers, runtime, driver, bf16 codec on the
                  in-memory twin of the transport), both stages in this process on the one GPU
  processes P=2   bootstrap + 2 stage processes over gRPC on loopback, both on the one GPU (--processes)

Prints tokens/s end to end, MFU (6N + 12*L*h*s FLOPs per token against --peak-tflops), and each
stage's busy-time MFU: its own FLOPs over the seconds its compute thread was busy (both stages
share one GPU, so a busy second may include waiting for the other stage's kernels).
With --price-steps N, also trains exact vs overlap for N steps per --seeds and prints the held-out
loss of each (the price of pipeline.schedule = overlap at this size). --runs picks the runs (the
plain loop is the baseline of every ratio, so keep hf); --json is rewritten after each run, so a
run cut short by a timeout keeps what it measured. Where the time goes inside a stage:
benchmarks/gpu_profile.py.

    python benchmarks/gpu_stage.py --preset medium [--processes] [--price-steps 40 --seeds 0,1] [--json F]
    python benchmarks/gpu_stage.py --preset medium --runs hf,exact,overlap,processes --json F
    python benchmarks/gpu_stage.py --preset medium --runs hf,exact,processes --compile --json F  # compiled layers
    python benchmarks/gpu_stage.py --preset medium --runs hf,exact,overlap --subspace 128 --json F  # k = d/16 hops
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from noloco_node.config import ConfigError, load_config  # noqa: E402
from noloco_node.data.loader import PackedSequences  # noqa: E402
from noloco_node.model.build import run_model  # noqa: E402
from noloco_node.model.stage import LlamaStage  # noqa: E402
from noloco_node.node.in_process import InProcessSwarm  # noqa: E402
from noloco_node.node.manifest import load_run_inputs  # noqa: E402


def flops_per_token(c, seq: int, layers: range | None = None, head: bool = True) -> float:
    """6N + 12*L*h*s over the matmul parameters (attention and MLP of `layers`, the LM head)."""
    h, intermediate = c.hidden_size, c.intermediate_size
    kv = h * (c.num_key_value_heads or c.num_attention_heads) // c.num_attention_heads
    count = c.num_hidden_layers if layers is None else len(layers)
    n = count * (2 * h * h + 2 * h * kv + 3 * h * intermediate) + (h * c.vocab_size if head else 0)
    return 6 * n + 12 * count * h * seq


def autocast(args):
    return (
        torch.autocast("cuda", dtype=torch.bfloat16) if args.device == "cuda" else torch.autocast("cpu", enabled=False)
    )


def synchronize(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def peak_bytes(args) -> int:
    return torch.cuda.max_memory_allocated() if args.device == "cuda" else 0


# The in-process runs --runs may name, and what each sets. exact-waiting: the compute thread waits for
# each result before its next job (pipeline.overlap_result_copies = false), the baseline of the copies
# the worker now leaves to its waiter, in the same run.
IN_PROCESS_RUNS = {
    "exact": {"pipeline.schedule": "exact"},
    "exact-waiting": {"pipeline.schedule": "exact", "pipeline.overlap_result_copies": "false"},
    "overlap": {"pipeline.schedule": "overlap"},
}


def config_for(args, out: Path, **extra: str):
    sets = {
        "model.preset": args.preset,
        "model.seq_len": args.seq_len,
        "pipeline.batch_size": args.batch,
        "pipeline.microbatch_size": args.micro,
        "pipeline.num_stages": 2,
        "pipeline.device": args.device,
        "pipeline.activation_codec": args.codec,
        "pipeline.max_in_flight": args.max_in_flight,
        "inner.lr": 3e-4,
        "inner.warmup_steps": 4,
        "inner.total_steps": 1000,
        "outer.method": "none",
        "timeouts.rpc_s": 600,
        "timeouts.microbatch_s": 1200,
        "timeouts.receive_s": 600,
        "data.holdout_fraction": 0.02,
        "pipeline.compile": str(args.compile).lower(),
        "model.residual_subspace": args.subspace,
        **extra,
    }
    return load_config(overrides=[f"{k}={v}" for k, v in sets.items()])


def plain_step(model, opt, x: torch.Tensor, y: torch.Tensor, args) -> float:
    """One step of the plain loop: microbatches of args.micro accumulated, clipped, AdamW; the
    loss (reading it waits for the device, so a step is timed whole)."""
    n_micro = args.batch // args.micro
    total = 0.0
    for i in range(n_micro):
        sl = slice(i * args.micro, (i + 1) * args.micro)
        with autocast(args):
            logits = model(input_ids=x[sl]).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y[sl].reshape(-1)) / n_micro
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(total)


def plain_hf(llama_cfg, batches, args) -> dict:
    from transformers import LlamaForCausalLM

    llama_cfg._attn_implementation = "sdpa"
    with torch.device(args.device):  # initialised where it trains: no host copy of the whole model
        model = LlamaForCausalLM(llama_cfg).train()
    if args.compile:  # as pipeline.compile does a stage's: each decoder layer in place
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")

    def step(batch) -> float:
        return plain_step(model, opt, *(t.to(args.device, non_blocking=True) for t in batch), args)

    for _ in range(args.warmup):
        step(next(batches))
    synchronize(args)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(next(batches))
    synchronize(args)
    seconds = time.perf_counter() - start
    peak = peak_bytes(args)
    model = opt = None  # frees the GPU memory (the closure holds them) before the next case
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"tok_s": args.steps * args.batch * args.seq_len / seconds, "loss": loss, "peak_gib": peak / 2**30}


async def in_process(config, args, llama, ranges) -> dict:
    """Warm-up steps, then timed steps; tokens/s from the wall time of the timed ones, each stage's
    busy-time MFU from its compute thread's busy seconds during them."""
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    swarm = await InProcessSwarm(config, replicas=1).start()
    try:
        await swarm.train(args.warmup, timeout_s=1800)
        busy = [n.parts.compute.busy_s for n in swarm.nodes]
        start = time.perf_counter()
        await swarm.train(args.steps, timeout_s=1800)
        synchronize(args)
        seconds = time.perf_counter() - start
        busy = [n.parts.compute.busy_s - b for n, b in zip(swarm.nodes, busy)]
        tokens = args.steps * args.batch * args.seq_len
        stages = []
        for node, busy_s in zip(swarm.nodes, busy):
            fpt = flops_per_token(llama, args.seq_len, ranges[node.stage], head=node.parts.shape.is_last)
            stages.append(
                {"stage": node.stage, "busy_s": busy_s, "busy_mfu": tokens * fpt / busy_s / (args.peak_tflops * 1e12)}
            )
        driver = swarm.stage(0)[0].driver
        return {
            "tok_s": tokens / seconds,
            "stages": stages,
            "peak_gib": peak_bytes(args) / 2**30,
            "final_loss": driver.log.step_losses[-1],
            "staleness": driver.log.max_staleness,
        }
    finally:
        await swarm.stop()
        if args.device == "cuda":
            del swarm
            torch.cuda.empty_cache()  # the next run's memory check sees the whole device again


def held_out_loss(swarm: InProcessSwarm, args, count: int = 8) -> float:
    batches = PackedSequences(
        swarm.corpus,
        swarm.tokenizer,
        seq_len=args.seq_len,
        split="validation",
        holdout_fraction=swarm.config.data.holdout_fraction,
    ).batches(args.micro)
    losses = []
    with torch.no_grad(), autocast(args):
        for _, (inputs, labels) in zip(range(count), batches):
            x = inputs.to(args.device)
            for node in swarm.nodes:
                x = node.parts.stage(x)
            losses.append(float(LlamaStage.loss(x, labels.to(args.device))))
    return sum(losses) / len(losses)


async def price_of_overlap(args, out: Path) -> list[dict]:
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for schedule in ("exact", "overlap"):
            config = config_for(args, out, **{"pipeline.schedule": schedule, "run.seed": seed})
            swarm = await InProcessSwarm(config, replicas=1).start()
            try:
                await swarm.train(args.price_steps, timeout_s=3600)
                rows.append(
                    {
                        "seed": seed,
                        "schedule": schedule,
                        "held_out_loss": held_out_loss(swarm, args),
                        "train_loss_last": swarm.stage(0)[0].driver.log.step_losses[-1],
                    }
                )
            finally:
                await swarm.stop()
            print(
                f"price: seed {seed} {schedule:7s} held-out {rows[-1]['held_out_loss']:.4f} "
                f"(last train step {rows[-1]['train_loss_last']:.4f})",
                flush=True,
            )
    return rows


def processes(config_sets: list[str], args, out: Path) -> dict:
    from two_stage_runs import staged_swarm

    run_args = argparse.Namespace(steps=args.steps, warmup=args.warmup, batch=args.batch, seq_len=args.seq_len)
    return staged_swarm(config_sets, run_args, out / "processes", 2, timeout_s=args.swarm_timeout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="medium")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--max-in-flight", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device (H100/H200: 989)")
    p.add_argument("--processes", action="store_true", help="also the P=2 swarm as processes over gRPC")
    p.add_argument(
        "--runs", default="hf,exact,overlap", help="of hf, exact, exact-waiting, overlap (in-process), processes"
    )
    p.add_argument("--price-only", action="store_true", help="only the price of overlap (--price-steps, --seeds)")
    p.add_argument("--swarm-timeout", type=float, default=600)
    p.add_argument("--price-steps", type=int, default=0)
    p.add_argument("--seeds", default="0")
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--codec", default="bf16", help="pipeline.activation_codec of the node runs (int8: encoded on the GPU)"
    )
    p.add_argument(
        "--subspace",
        type=int,
        default=0,
        help="model.residual_subspace k of the node runs (the plain loop stays dense)",
    )
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the decoder layers: the plain loop's and pipeline.compile"
    )
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script's logic on a tiny model")
    args = p.parse_args()
    if args.subspace and (args.price_only or args.price_steps):
        p.error("the price of overlap chains dense stages: leave --subspace out of it")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_stage: torch sees no CUDA device on this machine; nothing measured.")
        return 0
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"
    result: dict = {"device": name, "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        config = config_for(args, out)
        corpus, tokenizer, _ = load_run_inputs(config)
        llama, ranges = run_model(config, len(tokenizer))
        fpt = flops_per_token(llama, args.seq_len)
        peak = args.peak_tflops * 1e12
        result["flops_per_token"], result["peak_flops"] = fpt, peak
        print(
            f"{result['device']}: {args.preset} hidden {llama.hidden_size} layers {llama.num_hidden_layers}, split "
            f"{[len(r) for r in ranges]}, seq {args.seq_len} batch {args.batch} micro {args.micro}"
            f"{', decoder layers compiled' if args.compile else ''}"
            f"{f', node runs with a residual subspace of {args.subspace}' if args.subspace else ''}",
            flush=True,
        )
        if args.price_only:
            result["price_of_overlap"] = asyncio.run(price_of_overlap(args, out))
            return save(args, result)
        batches = PackedSequences(corpus, tokenizer, seq_len=args.seq_len, shuffle_buffer=0).batches(args.batch)
        runs = set(args.runs.split(",")) | ({"processes"} if args.processes else set())
        hf = result["hf"] = plain_hf(llama, batches, args) if "hf" in runs else {"tok_s": float("nan"), "peak_gib": 0.0}
        print(
            f"plain HF          {hf['tok_s']:9.0f} tok/s  MFU {hf['tok_s'] * fpt / peak:.3f}  peak "
            f"{hf['peak_gib']:.1f} GiB",
            flush=True,
        )
        save(args, result)
        for name in [s for s in IN_PROCESS_RUNS if s in runs]:
            key = f"in_process_{name.replace('-', '_')}"
            try:
                run = result[key] = asyncio.run(
                    in_process(config_for(args, out, **IN_PROCESS_RUNS[name]), args, llama, ranges)
                )
            except ConfigError as exc:  # refused by the node's own memory check: say so, measure the rest
                result[key] = {"refused": str(exc)}
                print(f"in-process P=2 {name:7s} refused: {exc}", flush=True)
                continue
            busy = "  ".join(f"stage {s['stage']} busy MFU {s['busy_mfu']:.3f}" for s in run["stages"])
            print(
                f"in-process P=2 {name:7s} {run['tok_s']:9.0f} tok/s  MFU {run['tok_s'] * fpt / peak:.3f}  "
                f"x HF {run['tok_s'] / hf['tok_s']:.3f}  {busy}  peak {run['peak_gib']:.1f} GiB",
                flush=True,
            )
            save(args, result)
        if "processes" in runs:
            sets = [
                f"{k}={v}"
                for k, v in {
                    "model.preset": args.preset,
                    "model.seq_len": args.seq_len,
                    "pipeline.batch_size": args.batch,
                    "pipeline.microbatch_size": args.micro,
                    "pipeline.device": args.device,
                    "pipeline.activation_codec": args.codec,
                    "pipeline.max_in_flight": args.max_in_flight,
                    "pipeline.compile": str(args.compile).lower(),
                    "model.residual_subspace": args.subspace,
                    "outer.method": "none",
                    "inner.lr": 3e-4,
                    "timeouts.rpc_s": 600,
                    "timeouts.microbatch_s": 1200,
                    "timeouts.receive_s": 600,
                }.items()
            ]
            run = result["processes"] = processes(sets, args, out)
            print(
                f"processes P=2     {run['tok_s']:9.0f} tok/s  MFU {run['tok_s'] * fpt / peak:.3f}  "
                f"x HF {run['tok_s'] / hf['tok_s']:.3f}",
                flush=True,
            )
        if args.price_steps:
            result["price_of_overlap"] = asyncio.run(price_of_overlap(args, out))
    return save(args, result)


def save(args, result: dict) -> int:
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
