"""Training throughput of P = 2 and P = 4 stages x 1 replica, one process per stage over gRPC (one
torch thread each), in the exact and the overlap schedule (pipeline.schedule), against the same
model trained in one process with two threads (this machine's cores).

All train the same model on the same data for the same steps; tokens/s is measured over the
steps after a warm-up (the swarm from its stage-0 step timestamps, so start-up is excluded).
Prints each figure, its ratio to the one process, each final model's loss on held-out sequences
no run trains on (the stages' saved weights put together; so the overlap schedule's staleness shows
in the loss, next to exact mode's and the one process's), the last step's training loss, and how
many microbatches saw an inner step between their forward and backward. Each P's line first gives
the layer split and how
evenly whole layers can balance the stages (mean stage cost over the largest, by model/split.py's
cost model): a pipeline runs at its slowest stage, so with one process per core (P = 2 here) that
share bounds the ratio to one process. With the default 4 layers, P = 2 splits 3 + 1 at 0.88;
`--layers 8` splits 5 + 3 at 0.93.

    .venv/bin/python benchmarks/pipeline_throughput.py [--steps 20] [--warmup 3] [--hidden 256] [--stages 2 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from two_stage_runs import held_out_batches, held_out_loss, one_process, staged_swarm, steadiness

from noloco_node.config import load_config
from noloco_node.model.build import run_model, stage_ranges
from noloco_node.model.split import model_costs
from noloco_node.data.corpus import resolve_corpus
from noloco_node.data.tokenizer import load_tokenizer


def overrides(args, cache_dir: str) -> list[str]:
    return [
        f"data.cache_dir={cache_dir}",
        f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={args.hidden * 11 // 4}",
        f"model.num_layers={args.layers}",
        "model.num_heads=4",
        f"model.seq_len={args.seq_len}",
        f"pipeline.batch_size={args.batch}",
        f"pipeline.microbatch_size={args.micro}",
        f"pipeline.activation_codec={args.codec}",
        "inner.lr=1e-3",
        "inner.warmup_steps=1",
        f"inner.total_steps={args.steps + args.warmup}",
        "outer.method=none",
        "pipeline.max_in_flight=16",
    ]


def split_bound(llama, stages: int, seq_len: int) -> tuple[list[int], float]:
    """The layers per stage the node computes, and the throughput a pipeline of whole layers can
    reach at best against a perfect split: mean stage cost / the largest (model/split.py's cost model)."""
    embed, layer, head = model_costs(llama, seq_len=seq_len)
    ranges = stage_ranges(llama, stages, seq_len=seq_len)
    costs = [
        len(r) * layer + (embed if s == 0 else 0.0) + (head if s == stages - 1 else 0.0) for s, r in enumerate(ranges)
    ]
    return [len(r) for r in ranges], sum(costs) / len(costs) / max(costs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--codec", default="bf16", choices=["none", "bf16", "int8"])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--eval-batches", type=int, default=8, help="held-out batches the final models are evaluated on"
    )
    parser.add_argument("--schedules", nargs="+", default=["exact", "overlap"], choices=["exact", "overlap"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sets = overrides(args, tmp)
        config = load_config(overrides=sets)
        corpus = resolve_corpus(None, cache_dir=config.data.cache_path)
        tokenizer = load_tokenizer(None, corpus, vocab_size=config.data.vocab_size, cache_dir=config.data.cache_path)
        print(
            f"model: hidden {args.hidden}, {args.layers} layers, vocab {len(tokenizer)}, seq {args.seq_len}; "
            f"batch {args.batch} in microbatches of {args.micro}; activations {args.codec}; {args.steps} timed steps"
        )
        held_out = held_out_batches(
            config, corpus, tokenizer, seq_len=args.seq_len, batch=args.batch, count=args.eval_batches
        )
        evaluated: list[float] = []
        baseline, _ = one_process(
            config, corpus, tokenizer, args, on_trained=lambda sim: evaluated.append(sim.validation_loss(held_out))
        )
        [baseline_loss] = evaluated
        print(
            f"held-out loss: {len(held_out) * args.batch} sequences the training never sees, after "
            f"{args.steps + args.warmup} steps"
        )
        print(f"one process, 2 threads: {baseline:9.0f} tokens/s, held-out loss {baseline_loss:.4f}")
        results = {"one_process_tok_s": baseline, "one_process_held_out_loss": baseline_loss, "swarms": []}
        llama, _ = run_model(config, len(tokenizer))
        for stages in args.stages:
            layers, bound = split_bound(llama, stages, args.seq_len)
            print(
                f"P={stages}: layers per stage {layers}; whole layers balance the stages to {bound:.2f} of a perfect "
                "split"
            )
            staged_config = load_config(overrides=sets + [f"pipeline.num_stages={stages}"])
            for schedule in args.schedules:
                run = staged_swarm(
                    sets + [f"pipeline.schedule={schedule}"],
                    args,
                    Path(tmp) / f"swarm-{stages}-{schedule}",
                    stages,
                    save_weights=True,
                )
                loss = held_out_loss(staged_config, tokenizer, run["weights"], held_out)
                results["swarms"].append(
                    {
                        "stages": stages,
                        "schedule": schedule,
                        "layers_per_stage": layers,
                        "split_balance": bound,
                        "tok_s": run["tok_s"],
                        "held_out_loss": loss,
                        "ratio": run["tok_s"] / baseline,
                        "final_loss": run["final_loss"],
                        **run["schedule"],
                    }
                )
                print(
                    f"P={stages} x 1 {schedule:7s} over gRPC, 1 thread/process: {run['tok_s']:9.0f} tokens/s, "
                    f"ratio {run['tok_s'] / baseline:.3f}, held-out loss {loss:.4f} (last step's training "
                    f"loss {run['final_loss']:.4f}), stale microbatches {run['schedule']['stale_microbatches']} "
                    f"(max {run['schedule']['max_staleness']} step)",
                    flush=True,
                )
        again, _ = one_process(config, corpus, tokenizer, args)
        mean, steady = steadiness(baseline, again)
        print(steady)
        results["one_process_tok_s_again"] = again
        if abs(mean - baseline) > 1e-9:  # the ratios above used the first; these use both
            for run in results["swarms"]:
                run["ratio"] = run["tok_s"] / mean
            print(
                "ratios against the mean: "
                + ", ".join(f"P={r['stages']} {r['schedule']} {r['ratio']:.3f}" for r in results["swarms"])
            )
        print(json.dumps(results))


if __name__ == "__main__":
    main()
