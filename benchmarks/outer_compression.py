"""The price in loss of the outer exchange's codecs: NoLoCo with phi sent as a rotating seeded slice
(outer.codec_phi = slice:F) and/or Delta as chunked top-k with 2- or 4-bit values
(outer.codec_delta = topk:F+int2 / +int4), against uncompressed NoLoCo, at equal inner steps.

One process (node/in_process.py): D replicas of each of P stages assembled as real nodes are, over
the in-memory pairing hub; pairs are drawn per round (sync/noloco.py: drawn_mate), so they change
from round to round. Every (variant, seed) cell trains the same steps from the same phi_0 and the
same data order (run.seed), so the difference to the baseline is taken seed by seed (paired).

Per cell, after the last round (steps a multiple of H, so theta = phi on every replica):
  held-out loss   each replica column's model on the same --eval-batches of the held-out split
                  (PackedSequences(split="validation"), data.holdout_fraction), mean over columns,
                  and their std ("loss std")
  phi spread      per stage, sqrt(mean_r ||phi_r - mean phi||^2) / ||mean phi||, mean over stages
  bytes           what one node sends per outer round (the history's bytes: phi + Delta, or theta),
                  mean over rounds and nodes, and the history's fp32_fraction (the same against the
                  dense fp32 phi + Delta of the round)
  rounds          paired and solo rounds, summed over nodes

The report: mean +- std over seeds per variant, and the paired difference of the held-out loss to
the baseline (mean +- 2 SE over seeds); a variant whose |difference| <= 2 SE is "inside the noise".

By default the outer exchange blocks (outer.overlap = false): the round is applied at its boundary,
so a cell is deterministic up to thread timing and the paired difference holds the codec's effect
alone; --overlap runs the product default instead. outer.max_distance_ratio is 1000 by default
here, not the product's 10: with 10, once the cosine LR has decayed an honest partner's distance
(the replicas' spread) exceeds 10x our own drift, the snapshot is rejected and the round goes solo,
but only where phi travels whole (a sliced phi is our own off its slice, so the check hardly sees
the spread): the baseline lost rounds the slice variants kept (docs/experiments/outer_compression).

    .venv/bin/python benchmarks/outer_compression.py --hidden 64 --steps 200 --every 10 --seeds 0,1,2 \\
        --variants baseline,s0.0625,s0.01,k0.02i2,k0.05i2,s0.0625+k0.02i2,s0.01+k0.02i2 \\
        --out docs/experiments/outer_compression          # the committed run, ~25 min on 2 loaded cores
    .venv/bin/python benchmarks/outer_compression.py --variants baseline,s0.0625+k0.02i2 --steps 40 --seeds 0
    .venv/bin/python benchmarks/outer_compression.py --list      # the variants' names
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from noloco_node.config import load_config  # noqa: E402
from noloco_node.data.loader import PackedSequences  # noqa: E402
from noloco_node.model.stage import LlamaStage  # noqa: E402
from noloco_node.node.in_process import InProcessSwarm  # noqa: E402

# name -> (codec_phi, codec_delta)
VARIANTS = {
    "baseline": ("none", "none"),
    "s0.25": ("slice:0.25", "none"),
    "s0.0625": ("slice:0.0625", "none"),
    "s0.01": ("slice:0.01", "none"),
    "k0.02i2": ("none", "topk:0.02+int2"),
    "k0.02i4": ("none", "topk:0.02+int4"),
    "k0.05i2": ("none", "topk:0.05+int2"),
    "s0.0625+k0.02i2": ("slice:0.0625", "topk:0.02+int2"),
    "s0.01+k0.02i2": ("slice:0.01", "topk:0.02+int2"),
    "s0.03125+k0.02i4": ("slice:0.03125", "topk:0.02+int4"),
}
FIELDS = [
    "variant",
    "codec_phi",
    "codec_delta",
    "seed",
    "held_out_loss",
    "loss_std",
    "phi_spread",
    "train_loss_last",
    "bytes_per_round",
    "phi_bytes",
    "delta_bytes",
    "fp32_fraction",
    "payload",
    "paired",
    "solo",
    "rejected",
    "rounds",
    "partners_distinct",
    "wall_s",
]
NUMERIC = set(FIELDS) - {"variant", "codec_phi", "codec_delta", "payload", "seed"}


def make_config(args, workdir: Path, seed: int, codec_phi: str, codec_delta: str):
    sets = {
        "model.preset": args.preset,
        "model.seq_len": args.seq_len,
        "data.vocab_size": args.vocab,
        "data.holdout_fraction": args.holdout,
        "data.cache_dir": str(workdir / "cache"),
        "pipeline.num_stages": args.stages,
        "pipeline.batch_size": args.batch,
        "pipeline.microbatch_size": args.micro,
        "pipeline.device": "cpu",
        "inner.lr": args.lr,
        "inner.warmup_steps": args.warmup,
        "inner.total_steps": args.steps,
        "outer.method": "noloco",
        "outer.inner_steps_per_outer": args.every,
        "outer.overlap": args.overlap,
        "outer.codec_phi": codec_phi,
        "outer.codec_delta": codec_delta,
        "run.seed": seed,
        "outer.max_distance_ratio": args.max_distance_ratio,
        "timeouts.match_s": args.match_s,
        "timeouts.rpc_s": 600,
        "timeouts.microbatch_s": 600,
        "timeouts.receive_s": 600,
    }
    if args.hidden:
        sets.update(
            {
                "model.hidden_size": args.hidden,
                "model.intermediate_size": args.intermediate,
                "model.num_layers": args.layers,
                "model.num_heads": args.heads,
            }
        )
    return load_config(overrides=[f"{k}={v}" for k, v in sets.items()])


def held_out(swarm: InProcessSwarm, args) -> list[float]:
    """Held-out loss of each replica column r (replica r of every stage), on the same batches."""
    config = swarm.config
    batches = PackedSequences(
        swarm.corpus,
        swarm.tokenizer,
        seq_len=config.model.seq_len,
        split="validation",
        holdout_fraction=config.data.holdout_fraction,
    ).batches(args.eval_batch)
    data = [b for _, b in zip(range(args.eval_batches), batches)]
    if len(data) < args.eval_batches:
        raise SystemExit(f"the held-out split has {len(data)} batches of {args.eval_batch}, fewer than --eval-batches")
    stages = [swarm.stage(s) for s in range(config.pipeline.num_stages)]
    losses = []
    with torch.no_grad():
        for column in range(swarm.replicas):
            total = 0.0
            for inputs, labels in data:
                x = inputs
                for stage in stages:
                    x = stage[column].parts.stage(x)
                total += float(LlamaStage.loss(x, labels))
            losses.append(total / len(data))
    return losses


def phi_spread(swarm: InProcessSwarm) -> float:
    """Per stage sqrt(mean_r ||phi_r - mean||^2) / ||mean||, averaged over stages."""
    spreads = []
    for s in range(swarm.config.pipeline.num_stages):
        states = [n.parts.outer_state.phi for n in swarm.stage(s)]
        dev2, ref2 = 0.0, 0.0
        for name in states[0]:
            stack = torch.stack([st[name].double() for st in states])
            mean = stack.mean(0)
            dev2 += float((stack - mean).pow(2).sum()) / len(states)
            ref2 += float(mean.pow(2).sum())
        spreads.append(math.sqrt(dev2 / ref2))
    return statistics.mean(spreads)


async def cell(args, workdir: Path, variant: str, seed: int) -> dict:
    codec_phi, codec_delta = VARIANTS[variant]
    config = make_config(args, workdir, seed, codec_phi, codec_delta)
    start = time.monotonic()
    swarm = await InProcessSwarm(config, replicas=args.replicas).start()
    try:
        await swarm.train(args.steps, timeout_s=args.cell_timeout)
        await swarm.settle()
        losses = held_out(swarm, args)
        spread = phi_spread(swarm)
    finally:
        await swarm.stop()
    history = [r for node in swarm.nodes for r in node.sync.counters.history]
    expected_rounds = args.steps // args.every
    for node in swarm.nodes:
        got = [r["round"] for r in node.sync.counters.history]
        if got != list(range(1, expected_rounds + 1)):
            raise RuntimeError(f"{variant} seed {seed}: {node.peer_id} ran rounds {got}, not 1..{expected_rounds}")
    totals = [sum(r["bytes"].values()) for r in history]
    pairs = {
        frozenset((node.peer_id, r["partner"]))
        for node in swarm.nodes
        for r in node.sync.counters.history
        if r["outcome"] == "paired"
    }
    train_last = [statistics.mean(n.driver.log.step_losses[-args.every :]) for n in swarm.stage(0)]
    return {
        "variant": variant,
        "codec_phi": codec_phi,
        "codec_delta": codec_delta,
        "seed": seed,
        "held_out_loss": statistics.mean(losses),
        "loss_std": statistics.pstdev(losses),
        "phi_spread": spread,
        "train_loss_last": statistics.mean(train_last),
        "bytes_per_round": statistics.mean(totals),
        "phi_bytes": statistics.mean(r["bytes"].get("phi", r["bytes"].get("theta", 0)) for r in history),
        "delta_bytes": statistics.mean(r["bytes"].get("delta", 0) for r in history),
        "fp32_fraction": statistics.mean(r["fp32_fraction"] for r in history),
        "payload": history[0]["payload"],
        "paired": sum(r["outcome"] == "paired" for r in history),
        "solo": sum(r["outcome"] != "paired" for r in history),
        "rejected": sum(r["reason"] == "rejected" for r in history),
        "rounds": len(history),
        "partners_distinct": len(pairs),
        "wall_s": time.monotonic() - start,
    }


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def report(rows: list[dict], args, variants: list[str], seeds: list[int], numel: int, command: str) -> str:
    out = io.StringIO()
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"# Outer compression: the price in held-out loss\n\ncommand: {command}\n")
    p(
        f"NoLoCo, D = {args.replicas} x P = {args.stages}, {args.steps} inner steps, H = {args.every} "
        f"({args.steps // args.every} outer rounds), seeds {','.join(map(str, seeds))}, overlap {args.overlap}, "
        f"max_distance_ratio {args.max_distance_ratio:g}; "
        f"{numel} parameters per stage (mean), fp32 phi + Delta = {8 * numel} bytes per round; "
        f"held-out loss on {args.eval_batches} x {args.eval_batch} sequences of {args.seq_len} tokens.\n"
    )
    by = {(r["variant"], r["seed"]): r for r in rows}
    p(
        "| variant | codec_phi | codec_delta | held-out loss | loss std (replicas) | phi spread | "
        "bytes/round/node | fp32 fraction | paired/solo (rejected) |"
    )
    p("|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        cells = [by[(v, s)] for s in seeds if (v, s) in by]
        if not cells:
            continue
        f = lambda key, fmt: "{} +- {}".format(*(format(x, fmt) for x in mean_std([c[key] for c in cells])))  # noqa: E731
        p(
            f"| {v} | {cells[0]['codec_phi']} | {cells[0]['codec_delta']} | {f('held_out_loss', '.4f')} | "
            f"{f('loss_std', '.4f')} | {f('phi_spread', '.5f')} | "
            f"{statistics.mean(c['bytes_per_round'] for c in cells):.0f} | "
            f"{statistics.mean(c['fp32_fraction'] for c in cells):.4f} | "
            f"{sum(c['paired'] for c in cells)}/{sum(c['solo'] for c in cells)} ({sum(c['rejected'] for c in cells)}) |"
        )
    p(
        "\nPaired difference of the held-out loss to the baseline, seed by seed (variant - baseline), "
        "mean +- 2 SE over seeds; inside the noise when |mean| <= 2 SE:\n"
    )
    p("| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | mean +- 2 SE | verdict | phi spread diff |")
    p("|---|" + "---|" * len(seeds) + "---|---|---|")
    for v in variants:
        if v == "baseline":
            continue
        diffs = {
            s: by[(v, s)]["held_out_loss"] - by[("baseline", s)]["held_out_loss"]
            for s in seeds
            if (v, s) in by and ("baseline", s) in by
        }
        if not diffs:
            continue
        values = list(diffs.values())
        mean = statistics.mean(values)
        se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
        verdict = (
            "n/a (one seed)"
            if math.isnan(se)
            else "inside the noise"
            if abs(mean) <= 2 * se
            else ("higher" if mean > 0 else "lower") + ", outside the noise"
        )
        sdiff = [by[(v, s)]["phi_spread"] - by[("baseline", s)]["phi_spread"] for s in diffs]
        p(
            f"| {v} | "
            + " | ".join(f"{diffs[s]:+.4f}" if s in diffs else "-" for s in seeds)
            + f" | {mean:+.4f} +- {2 * se:.4f} | {verdict} | {statistics.mean(sdiff):+.5f} |"
        )
    possible = min(args.replicas * (args.replicas - 1) // 2, args.steps // args.every * (args.replicas // 2))
    poor = [
        f"{r['variant']} seed {r['seed']} ({r['partners_distinct']} of {possible})"
        for r in rows
        if int(r["partners_distinct"]) < possible
    ]
    if poor:
        p(
            f"\nPoorly mixed cells (fewer distinct pairs of replicas met than the {possible} possible; "
            f"the drawn pairing fell back to who reached the round first): {', '.join(poor)}."
        )
    return out.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names (--list)")
    p.add_argument("--list", action="store_true", help="print the variants and exit")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=20, help="H, inner steps per outer round")
    p.add_argument("--replicas", type=int, default=4, help="D, replicas per stage")
    p.add_argument("--stages", type=int, default=1, help="P")
    p.add_argument("--preset", default="tiny")
    p.add_argument(
        "--hidden", type=int, default=0, help="override the preset's shape (with --intermediate, --layers, --heads)"
    )
    p.add_argument("--intermediate", type=int, default=176)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--holdout", type=float, default=0.02)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--overlap", action="store_true", help="outer.overlap = true (the product default)")
    p.add_argument("--match-s", type=float, default=5.0)
    p.add_argument(
        "--max-distance-ratio",
        type=float,
        default=1000.0,
        help="outer.max_distance_ratio; the product's 10 rejects honest partners once the LR has decayed "
        "(their distance stays, our drift shrinks), and only where phi travels whole (README)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--cell-timeout", type=float, default=3600)
    p.add_argument("--out", type=Path, help="write report.md, results.csv and command.txt here")
    p.add_argument("--reprint", type=Path, help="print the report of a results.csv again (with the same flags)")
    args = p.parse_args()
    if args.list:
        for name, (phi, delta) in VARIANTS.items():
            print(f"{name:18s} codec_phi={phi:14s} codec_delta={delta}")
        return 0
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; --list shows them")
    if "baseline" not in variants:
        variants.insert(0, "baseline")
    if args.steps % args.every:
        p.error("--steps must be a multiple of --every (so every replica ends on theta = phi)")
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.reprint:
        with args.reprint.open() as f:
            rows = [{k: (float(v) if k in NUMERIC else v) for k, v in r.items()} for r in csv.DictReader(f)]
        for r in rows:
            r["seed"] = int(r["seed"])
        numel = round(float(rows[-1]["bytes_per_round"]) / 8 / float(rows[-1]["fp32_fraction"]))
        print(
            report(
                [r for r in rows if r["variant"] in variants],
                args,
                variants,
                seeds,
                numel,
                f"(reprinted from {args.reprint})",
            )
        )
        return 0
    torch.set_num_threads(args.threads)
    command = ".venv/bin/python benchmarks/outer_compression.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows: list[dict] = []
    csv_file = None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "command.txt").write_text(command + "\n")
        csv_file = (args.out / "results.csv").open("w", newline="")
        writer = csv.DictWriter(csv_file, fieldnames=FIELDS)
        writer.writeheader()
    started = time.monotonic()
    numel = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:  # seed-major: a stopped run still has whole seeds to pair
            for variant in variants:
                row = asyncio.run(cell(args, Path(tmp), variant, seed))
                rows.append(row)
                numel = round(row["bytes_per_round"] / 8 / row["fp32_fraction"]) if row["fp32_fraction"] else numel
                print(
                    f"seed {seed} {variant:18s} held-out {row['held_out_loss']:.4f} (replica std "
                    f"{row['loss_std']:.4f}) "
                    f"spread {row['phi_spread']:.5f} bytes/round {row['bytes_per_round']:.0f} "
                    f"fp32 {row['fp32_fraction']:.4f} paired/solo {row['paired']}/{row['solo']} rejected "
                    f"{row['rejected']} "
                    f"pairs {row['partners_distinct']} [{row['wall_s']:.0f} s, total "
                    f"{time.monotonic() - started:.0f} s]",
                    flush=True,
                )
                if csv_file:
                    writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
                    csv_file.flush()
    text = report(rows, args, variants, seeds, numel, command)
    text += f"\nTotal wall time {time.monotonic() - started:.0f} s.\n"
    print(text)
    if args.out:
        csv_file.close()
        (args.out / "report.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
