"""The price of pipeline.schedule = overlap, and where it comes from: for each seed, the held-out loss
after N steps of

  pipeline exact     the node's parts in one process (node/in_process.py), P = 2, schedule exact
  pipeline overlap   the same, schedule overlap (weight stashing, at most one step stale)
  one-process exact  the whole model, plain Adam, the same data and schedule
  one-process stale  the same, but every batch's gradient taken at the weights from before the
                     previous step (all of it one step stale, no pipeline, no stash)

If the overlap gap (overlap - exact) matches the stale gap (stale - exact), what overlap costs is
the one-step staleness itself, not a defect of the weight stash; a stash defect would show as a
pipeline gap the staleness alone does not explain. Loss at equal steps, not speed: any machine.

    python benchmarks/overlap_price.py --preset tiny --seq-len 256 --steps 80 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_stage import config_for, held_out_loss  # noqa: E402

from noloco_node.data.loader import PackedSequences, ShardSpec  # noqa: E402
from noloco_node.model.build import run_model  # noqa: E402
from noloco_node.model.stage import LlamaStage, build_full_model  # noqa: E402
from noloco_node.node.in_process import InProcessSwarm  # noqa: E402
from noloco_node.node.manifest import load_run_inputs  # noqa: E402
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule  # noqa: E402


async def pipeline(args, seed: int, schedule: str) -> float:
    config = config_for(args, Path("."), **{"pipeline.schedule": schedule, "run.seed": seed})
    swarm = await InProcessSwarm(config, replicas=1).start()
    try:
        await swarm.train(args.steps, timeout_s=3600)
        return held_out_loss(swarm, args)
    finally:
        await swarm.stop()


def one_process(args, seed: int, stale: bool) -> float:
    config = config_for(args, Path("."), **{"run.seed": seed})
    corpus, tokenizer, _ = load_run_inputs(config)
    llama, _ = run_model(config, len(tokenizer))
    model = build_full_model(llama, seed).to(args.device)
    inner = config.inner
    optimizer = InnerOptimizer(
        model.parameters(),
        InnerSchedule(lr_max=inner.lr, warmup_steps=inner.warmup_steps, total_steps=inner.total_steps),
    )
    behind = copy.deepcopy(model)  # the weights before the previous step
    batches = PackedSequences(
        corpus,
        tokenizer,
        seq_len=args.seq_len,
        shard=ShardSpec(shard_index=0, num_shards=1),
        holdout_fraction=config.data.holdout_fraction,
        seed=seed,
        shuffle_buffer=1000,
    ).batches(args.batch)
    for _ in range(args.steps):
        inputs, labels = (t.to(args.device) for t in next(batches))
        net = behind if stale else model
        for i in range(0, args.batch, args.micro):
            loss = LlamaStage.loss(net(input_ids=inputs[i : i + args.micro]).logits, labels[i : i + args.micro])
            (loss * args.micro / args.batch).backward()
        if stale:
            for p, q in zip(model.parameters(), behind.parameters()):
                p.grad, q.grad = q.grad, None
            behind.load_state_dict(model.state_dict())  # the next batch sees the weights before this step
        optimizer.step()
    held_out = PackedSequences(
        corpus, tokenizer, seq_len=args.seq_len, split="validation", holdout_fraction=config.data.holdout_fraction
    ).batches(args.micro)
    with torch.no_grad():
        losses = [
            float(LlamaStage.loss(model(input_ids=x.to(args.device)).logits, y.to(args.device)))
            for _, (x, y) in zip(range(8), held_out)
        ]
    return sum(losses) / len(losses)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--max-in-flight", type=int, default=8)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(1)
    gaps = {"overlap": [], "stale": []}
    for seed in [int(s) for s in args.seeds.split(",")]:
        exact, overlap = asyncio.run(pipeline(args, seed, "exact")), asyncio.run(pipeline(args, seed, "overlap"))
        plain, stale = one_process(args, seed, False), one_process(args, seed, True)
        gaps["overlap"].append(overlap - exact)
        gaps["stale"].append(stale - plain)
        print(
            f"seed {seed}: pipeline exact {exact:.4f} overlap {overlap:.4f} (gap {overlap - exact:+.4f}); "
            f"one process exact {plain:.4f} stale {stale:.4f} (gap {stale - plain:+.4f})",
            flush=True,
        )
    for name, values in gaps.items():
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{name} gap: {statistics.mean(values):+.4f} +- {spread:.4f} (mean +- std over {len(values)} seeds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
