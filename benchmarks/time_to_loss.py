"""Time to a given loss over a link: dense pipeline hops (bf16, int8, int4) against a residual stream
in a subspace of rank k (model.residual_subspace, model/subspace.py) with a codec on top (issue 32).

One process trains a P = 2, D = 1 pipeline per configuration and seed: the run's two stages as the
nodes build them (model/build.py: build_run_stage, the split by cost), the embedded corpus and
tokenizer (node/manifest.py: load_run_inputs; nothing is downloaded), each stage's own
InnerOptimizer and InnerSchedule (optim/inner.py, as tests/oracle.py). Every microbatch crosses the
boundary as the wire carries it: stage 0's output (hidden states [b, T, d], or fp32 coordinates
[b, T, k] of a subspace model, whose stage 1 also takes the token ids) is encoded with the hop's
codec and decoded (codec/tensors.py, as pipeline/memory.py's through_wire), and so is the gradient
sent back (int4 gradients round stochastically, as rpc/stage_service.py sends them); so the codecs'
noise is in the loss. On CUDA the stages compute under bf16 autocast (fp32 weights), as the worker.

Per configuration and seed (run.seed draws phi_0, U and the fixed embedding, and the data order):
the held-out loss (PackedSequences(split="validation"), data.holdout_fraction as in the config, the
same fixed --eval-batches for every run, the model alone without a codec) every --eval-every steps.
Dense runs --steps steps; subspace runs --extend x as many, since it may need more tokens; every run
uses one LR schedule (cosine over the longest run), so all curves share the LR at every step.

Compute: each configuration's stages are timed alone (--time-steps after --time-warmup, in this
process before any training, so parallel training workers never share the device with a timing):
stage 0's forward + backward and stage 1's forward + backward per microbatch, medians; the codec's
encode + decode on the host is timed and reported beside them, not counted. Wall-clock per inner
step over a link: model/costs.py's inner_step_seconds with those compute times (GPipe fill and
drain, exact schedule, pipeline.max_in_flight), the hop's bytes from pipeline_costs (codec, k, token
ids, CALL_OVERHEAD_BYTES per call) at --links Mbit/s (a shared home uplink, --rtt-ms). The outer
exchange is left out (D = 1): the subspace's k-wide output projections would shrink it a little.

Target: per seed, the held-out loss dense bf16 reaches at its last evaluation (and, with --targets,
at fractions of its run: 0.5 by default, a looser target every configuration may reach). The step
that reaches it is where the curve first crosses it, linear between evaluations (so dense bf16
reaches the first target at its end or before); tokens-to-target = that step x tokens per step,
time-to-target = that step x the step's seconds on the link. Mean +- std over the seeds that reach
it, and how many do: a configuration that does not within its run says so.

--workers N trains N (configuration, seed) runs at once in spawned processes (a GPU has room and
the codec's host work spreads over the cores); each uses --threads torch threads.

    .venv/bin/python benchmarks/time_to_loss.py --preset tiny --steps 300 --seeds 0,1,2 --json F
    python benchmarks/time_to_loss.py --device cuda --hidden 1024 --layers 8 --heads 16 \\
        --seq-len 256 --batch 8 --micro 2 --steps 300 --workers 12 --json F
    .venv/bin/python benchmarks/time_to_loss.py --reprint F [--links 20,100,1000]   # the tables again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from noloco_node.codec.tensors import DTYPES, decode_into, encode  # noqa: E402
from noloco_node.config import load_config  # noqa: E402
from noloco_node.data.loader import PackedSequences, ShardSpec  # noqa: E402
from noloco_node.model.build import build_run_stage, run_model  # noqa: E402
from noloco_node.model.costs import Link, inner_step_seconds, pipeline_costs  # noqa: E402
from noloco_node.model.stage import LlamaStage  # noqa: E402
from noloco_node.node.manifest import load_run_inputs  # noqa: E402
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule  # noqa: E402


def parse_configs(text: str, hidden: int) -> list[dict]:
    """'dense:bf16,sub8:int4,...': dense with a hop codec, or the subspace at k = hidden / 8."""
    out = []
    for item in text.split(","):
        kind, codec = item.split(":")
        k = 0 if kind == "dense" else hidden // int(kind.removeprefix("sub"))
        out.append(
            {"name": item if kind == "dense" else f"k={k} (d/{kind[3:]}):{codec}", "key": item, "k": k, "codec": codec}
        )
    return out


def make_config(args, seed: int, k: int, total_steps: int):
    sets = {
        "model.preset": args.preset,
        "model.seq_len": args.seq_len,
        "pipeline.batch_size": args.batch,
        "pipeline.microbatch_size": args.micro,
        "pipeline.num_stages": 2,
        "pipeline.device": args.device,
        "inner.lr": args.lr,
        "inner.warmup_steps": args.warmup_steps,
        "inner.total_steps": total_steps,
        "outer.method": "none",
        "run.seed": seed,
        "model.residual_subspace": k,
    }
    for field, value in (
        ("hidden_size", args.hidden),
        ("num_layers", args.layers),
        ("num_heads", args.heads),
        ("intermediate_size", args.intermediate),
    ):
        if value:
            sets[f"model.{field}"] = value
    return load_config(overrides=[f"{key}={value}" for key, value in sets.items()])


def autocast(device: str):
    return (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.startswith("cuda")
        else torch.autocast("cpu", enabled=False)
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def wire(tensor: torch.Tensor, codec: str, stochastic: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    """The tensor a receiver decodes from `tensor` sent with `codec` (float32 values on the wire's
    declared dtype, as pipeline/memory.py's through_wire), and the payload bytes."""
    sent = tensor.detach().float().cpu()
    spec, payload = encode(sent, codec, dtype="float32", stochastic=stochastic if codec == "int4" else None)
    out = torch.empty(spec.shape, dtype=DTYPES[spec.dtype])
    decode_into(spec, payload, out)
    return out.to(tensor.device, non_blocking=True), len(payload)


class Pipeline:
    """The two stages of one run, their optimizers, and one microbatch through the wire."""

    def __init__(self, config, llama, ranges, device: str) -> None:
        self.config, self.device = config, device
        self.k = config.model.residual_subspace
        self.stages = [build_run_stage(config, llama, ranges, s, device=device).train() for s in range(2)]
        inner = config.inner
        schedule = InnerSchedule(
            lr_max=inner.lr,
            warmup_steps=inner.warmup_steps,
            total_steps=inner.total_steps,
            min_lr_ratio=inner.min_lr_ratio,
        )
        self.optimizers = [
            InnerOptimizer(
                s.parameters(),
                schedule,
                betas=(inner.beta1, inner.beta2),
                eps=inner.eps,
                weight_decay=inner.weight_decay,
                clip_norm=inner.clip_norm,
            )
            for s in self.stages
        ]
        self.rounding = torch.Generator().manual_seed(config.run.seed)
        self.hop_bytes = [0, 0]  # forward payload, backward payload (last microbatch)

    def microbatch(self, inputs, labels, codec: str, scale: float, timer: dict | None = None) -> float:
        s0, s1 = self.stages
        dev = self.device
        clock = (lambda: (sync(dev), time.perf_counter())[1]) if timer is not None else (lambda: 0.0)
        t0 = clock()
        with autocast(dev):
            out = s0(inputs)
        t1 = clock()
        received, self.hop_bytes[0] = wire(out, codec)
        t2 = clock()
        received.requires_grad_(True)
        with autocast(dev):
            logits = s1(received, inputs) if self.k else s1(received)
        loss = LlamaStage.loss(logits, labels)
        (loss * scale).backward()
        t3 = clock()
        grad, self.hop_bytes[1] = wire(received.grad, codec, self.rounding)
        t4 = clock()
        out.backward(grad)
        t5 = clock()
        if timer is not None:
            timer["stage0"].append((t1 - t0) + (t5 - t4))
            timer["stage1"].append(t3 - t2)
            timer["codec"].append((t2 - t1) + (t4 - t3))
        return loss.detach()

    def step(self, batch, codec: str, timer: dict | None = None) -> float:
        inputs, labels = (t.to(self.device, non_blocking=True) for t in batch)
        micro, size = self.config.pipeline.microbatch_size, inputs.shape[0]
        total = sum(
            self.microbatch(inputs[i : i + micro], labels[i : i + micro], codec, micro / size, timer)
            for i in range(0, size, micro)
        )
        for optimizer in self.optimizers:
            optimizer.step()
        return float(total) * micro / size

    @torch.no_grad()
    def held_out(self, batches) -> float:
        losses = []
        with autocast(self.device):
            for inputs, labels in batches:
                inputs, labels = inputs.to(self.device), labels.to(self.device)
                hidden = self.stages[0](inputs)
                logits = self.stages[1](hidden, inputs) if self.k else self.stages[1](hidden)
                losses.append(float(LlamaStage.loss(logits, labels)))
        return sum(losses) / len(losses)


def inputs_for(args, config):
    corpus, tokenizer, _ = load_run_inputs(config)
    llama, ranges = run_model(config, len(tokenizer))
    return corpus, tokenizer, llama, ranges


def eval_batches(args, config, corpus, tokenizer) -> list:
    it = PackedSequences(
        corpus, tokenizer, seq_len=args.seq_len, split="validation", holdout_fraction=config.data.holdout_fraction
    ).batches(args.micro)
    batches = [b for _, b in zip(range(args.eval_batches), it)]
    if len(batches) < args.eval_batches:
        print(f"  only {len(batches)} held-out batches of {args.micro} x {args.seq_len} in the corpus", flush=True)
    return batches


def train_run(args, cfg: dict, seed: int, steps: int, total_steps: int) -> dict:
    """One configuration and seed: the held-out curve (and the training loss) every --eval-every steps."""
    try:
        return _train_run(args, cfg, seed, steps, total_steps)
    except Exception as exc:  # noqa: BLE001 - some exceptions do not pickle back from a worker
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None


def _train_run(args, cfg: dict, seed: int, steps: int, total_steps: int) -> dict:
    torch.set_num_threads(args.threads)
    config = make_config(args, seed, cfg["k"], total_steps)
    corpus, tokenizer, llama, ranges = inputs_for(args, config)
    torch.manual_seed(seed)
    pipe = Pipeline(config, llama, ranges, args.device)
    held = eval_batches(args, config, corpus, tokenizer)
    train = PackedSequences(
        corpus,
        tokenizer,
        seq_len=args.seq_len,
        shard=ShardSpec(),
        holdout_fraction=config.data.holdout_fraction,
        seed=seed,
    ).batches(args.batch)
    curve = [{"step": 0, "tokens": 0, "held_out": pipe.held_out(held), "train": None}]
    start, window = time.perf_counter(), []
    run = {"config": cfg["key"], "seed": seed, "k": cfg["k"], "codec": cfg["codec"], "steps": steps, "curve": curve}
    for step in range(1, steps + 1):
        window.append(pipe.step(next(train), cfg["codec"]))
        if step % args.eval_every == 0 or step == steps:
            curve.append(
                {
                    "step": step,
                    "tokens": step * args.batch * args.seq_len,
                    "held_out": pipe.held_out(held),
                    "train": sum(window) / len(window),
                }
            )
            window = []
            run.update(
                seconds=time.perf_counter() - start,
                hop_bytes=list(pipe.hop_bytes),
                skipped_steps=[o.skipped_steps for o in pipe.optimizers],
            )
            if args.json:  # the curve so far, for a run that --deadline-s cuts
                partial = part_path(args, cfg, seed)
                partial.write_text(json.dumps(run | {"cut_at_step": step}))
    return run


def part_path(args, cfg: dict, seed: int) -> Path:
    folder = Path(args.json).with_suffix(".parts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{cfg['key'].replace(':', '_')}_seed{seed}.json"


def time_config(args, cfg: dict) -> dict:
    """Each stage's compute per microbatch (medians over the timed steps) with nothing else on the device."""
    config = make_config(args, 0, cfg["k"], 1000)
    corpus, tokenizer, llama, ranges = inputs_for(args, config)
    pipe = Pipeline(config, llama, ranges, args.device)
    train = PackedSequences(
        corpus, tokenizer, seq_len=args.seq_len, holdout_fraction=config.data.holdout_fraction, seed=0, shuffle_buffer=0
    ).batches(args.batch)
    for _ in range(args.time_warmup):
        pipe.step(next(train), cfg["codec"])
    timer = {"stage0": [], "stage1": [], "codec": []}
    for _ in range(args.time_steps):
        pipe.step(next(train), cfg["codec"], timer)
    out = {key: statistics.median(v) for key, v in timer.items()}
    out["hop_bytes"] = list(pipe.hop_bytes)
    out["params"] = [sum(p.numel() for p in s.parameters()) for s in pipe.stages]
    del pipe
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def link_seconds(args, llama, ranges, cfg: dict, timing: dict, mbit: float) -> tuple[float, str, float]:
    """(seconds per inner step, what limits it, predicted wire bytes per step) on `mbit`."""
    costs = pipeline_costs(
        llama,
        ranges,
        microbatch=args.micro,
        seq_len=args.seq_len,
        microbatches_per_batch=args.batch // args.micro,
        max_in_flight=args.max_in_flight,
        activation_codec=cfg["codec"],
        gradient_codec=cfg["codec"],
        subspace=cfg["k"],
    )
    step, _, limit = inner_step_seconds(
        costs, (timing["stage0"], timing["stage1"]), Link(mbit=mbit, rtt_ms=args.rtt_ms)
    )
    per_micro = (
        costs.hop_elements * (costs.activation_bytes + costs.gradient_bytes)
        + 2 * costs.call_overhead_bytes
        + costs.forward_extra_bytes
    )
    return step, limit, per_micro * costs.microbatches_per_batch


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def crossing(curve: list[dict], target: float) -> float | None:
    """The step at which the held-out curve first reaches `target`, linear between evaluations."""
    for before, point in zip(curve, curve[1:]):
        if point["held_out"] <= target:
            drop = before["held_out"] - point["held_out"]
            share = (before["held_out"] - target) / drop if drop > 0 else 1.0
            return before["step"] + min(1.0, max(0.0, share)) * (point["step"] - before["step"])
    return None


def target_losses(runs: list[dict], fraction: float, steps: int) -> dict[int, float]:
    """Per seed: dense bf16's held-out loss at the last evaluation at or before `fraction` of its run."""
    out = {}
    for r in runs:
        if r["config"] == "dense:bf16":
            out[r["seed"]] = [p for p in r["curve"] if p["step"] <= fraction * steps + 1e-9][-1]["held_out"]
    return out


def summarise(result: dict, links: list[float], fractions: list[float]) -> dict:
    """Per target (dense bf16's loss at each fraction of its run) and configuration: tokens- and
    time-to-target on each link (mean, std over the seeds that reach it; how many do)."""
    args = argparse.Namespace(**result["args_raw"])
    llama, ranges = result["_llama"], result["_ranges"]
    runs = result["runs"]
    link_rows = {}
    for cfg in result["configs"]:
        timing = result["timing"][cfg["key"]]
        link_rows[cfg["key"]] = {}
        for mbit in links:
            step_s, limit, nbytes = link_seconds(args, llama, ranges, cfg, timing, mbit)
            link_rows[cfg["key"]][str(mbit)] = {"step_s": step_s, "limited_by": limit, "bytes_per_step": nbytes}
    targets = []
    for fraction in fractions:
        target = target_losses(runs, fraction, args.steps)
        rows = []
        for cfg in result["configs"]:
            mine = [r for r in runs if r["config"] == cfg["key"] and r["seed"] in target]
            reach = {r["seed"]: crossing(r["curve"], target[r["seed"]]) for r in mine}
            steps = [s for s in reach.values() if s is not None]
            row = {
                "config": cfg["key"],
                "name": cfg["name"],
                "k": cfg["k"],
                "codec": cfg["codec"],
                "seeds": len(mine),
                "reached": len(steps),
                "run_steps": max((r["steps"] for r in mine), default=0),
                "cut": {str(r["seed"]): r["cut_at_step"] for r in mine if "cut_at_step" in r},
                "final_held_out": mean_std([r["curve"][-1]["held_out"] for r in mine]),
                "held_out_at_dense_end": mean_std(
                    [
                        x
                        for x in (
                            next((p["held_out"] for p in r["curve"] if p["step"] >= args.steps), None) for r in mine
                        )
                        if x is not None
                    ]
                ),
                "steps_to_target": {str(seed): s for seed, s in reach.items()},
                "tokens_to_target": mean_std([s * args.batch * args.seq_len for s in steps]),
                "links": {},
            }
            for mbit, link in link_rows[cfg["key"]].items():
                row["links"][mbit] = link | {"time_to_target_s": mean_std([s * link["step_s"] for s in steps])}
            rows.append(row)
        targets.append({"fraction": fraction, "target": target, "rows": rows})
    return {
        "targets": targets,
        "rtt_ms": args.rtt_ms,
        "compute_note": "stage seconds per microbatch measured alone; host codec time not counted",
    }


def fmt(ms: tuple[float, float], scale: float = 1.0, digits: int = 0) -> str:
    m, s = ms
    return "—" if math.isnan(m) else f"{m / scale:.{digits}f} ± {s / scale:.{digits}f}"


def cut_note(row: dict) -> str:
    return f" (cut at step {', '.join(map(str, row['cut'].values()))})" if row["cut"] else ""


def print_tables(result: dict, summary: dict, links: list[float]) -> None:
    steps = result["args_raw"]["steps"]
    for block in summary["targets"]:
        print(
            f"\n{result['shape']} on {result['device']}; target per seed = dense bf16's held-out loss at step "
            f"{block['fraction'] * steps:g} of {steps}: "
            + ", ".join(f"seed {s}: {v:.4f}" for s, v in block["target"].items())
        )
        print(
            "| config | held-out at step "
            + str(steps)
            + " | final held-out (run's steps) | reached | tokens to target (M) | "
            + " | ".join(f"time to target @{m:g} Mbit/s (s)" for m in links)
            + " |"
        )
        print("|" + "---|" * (5 + len(links)))
        for row in block["rows"]:
            never = f"not within {row['run_steps']} steps"
            print(
                f"| {row['name']} | {fmt(row['held_out_at_dense_end'], digits=3)} | "
                f"{fmt(row['final_held_out'], digits=3)} "
                f"({row['run_steps']}) | {row['reached']}/{row['seeds']}{cut_note(row)} | "
                + (
                    " | ".join(
                        [fmt(row["tokens_to_target"], 1e6, 3)]
                        + [fmt(row["links"][str(m)]["time_to_target_s"], digits=1) for m in links]
                    )
                    if row["reached"]
                    else " | ".join([never] * (1 + len(links)))
                )
                + " |"
            )
    print(
        f"\nper step: compute (stage seconds per microbatch, measured alone) and seconds on each link (model/costs.py, "
        f"RTT {summary['rtt_ms']:g} ms, shared uplink; what limits it), wire bytes per step"
    )
    for row in summary["targets"][0]["rows"]:
        t = result["timing"][row["config"]]
        print(
            f"  {row['name']:20s} stage0 {t['stage0'] * 1e3:6.2f} ms stage1 {t['stage1'] * 1e3:6.2f} ms, host codec "
            f"{t['codec'] * 1e3:5.2f} ms (not counted); {row['links'][str(links[0])]['bytes_per_step'] / 1e6:.3f} "
            "MB/step; "
            + "; ".join(
                f"{m:g}: {row['links'][str(m)]['step_s']:.3f} s ({row['links'][str(m)]['limited_by'].split(' (')[0]})"
                for m in links
            )
        )


def save(path: Path | None, result: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({k: v for k, v in result.items() if not k.startswith("_")}, indent=1, default=str))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--heads", type=int, default=0)
    p.add_argument("--intermediate", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--max-in-flight", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--steps", type=int, default=300, help="dense runs; subspace runs --extend x as many")
    p.add_argument("--extend", type=float, default=2.0)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument(
        "--configs", default="dense:bf16,dense:int8,dense:int4,sub8:int4,sub16:int4,sub32:int4,sub64:int4,sub16:bf16"
    )
    p.add_argument("--links", default="20,100,1000", help="Mbit/s, each a shared uplink")
    p.add_argument("--rtt-ms", type=float, default=30.0)
    p.add_argument("--time-steps", type=int, default=10)
    p.add_argument("--time-warmup", type=int, default=3)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=0,
        help="stop waiting for runs after this many seconds "
        "(0: none); what finished is kept and the table says which runs were cut",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--targets", default="1,0.5", help="targets: dense bf16's loss at these fractions of its run")
    p.add_argument(
        "--reprint",
        type=Path,
        help="the tables of a results JSON again (today's link model, --links, "
        "--targets); with --json, written there with the summary",
    )
    args = p.parse_args()
    links = [float(x) for x in args.links.split(",")]
    fractions = [float(x) for x in args.targets.split(",")]
    reprinting, out = args.reprint is not None, args.json
    result = None
    if reprinting:
        result = json.loads(args.reprint.read_text())
        args = argparse.Namespace(**result["args_raw"])
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available() and not reprinting:
        print("time_to_loss: torch sees no CUDA device on this machine; nothing measured.")
        return 0
    config = make_config(args, 0, 0, 1000)
    _, _, llama, ranges = inputs_for(args, config)
    cfgs = parse_configs(args.configs, llama.hidden_size)
    if result is None:
        t0 = time.perf_counter()
        device = (
            torch.cuda.get_device_name()
            if args.device.startswith("cuda")
            else f"cpu ({os.cpu_count()} cores, {args.threads} thread(s) per run)"
        )
        shape = (
            f"hidden {llama.hidden_size}, {llama.num_hidden_layers} layers ({[len(r) for r in ranges]}), "
            f"heads {llama.num_attention_heads}, intermediate {llama.intermediate_size}, vocab {llama.vocab_size}, "
            f"seq {args.seq_len}, batch {args.batch} in microbatches of {args.micro}"
        )
        result = {
            "device": device,
            "shape": shape,
            "args_raw": vars(args) | {"json": str(args.json), "reprint": None},
            "configs": cfgs,
            "timing": {},
            "runs": [],
        }
        print(f"{device}: {shape}", flush=True)
        for cfg in cfgs:
            result["timing"][cfg["key"]] = t = time_config(args, cfg)
            print(
                f"  timed {cfg['name']:22s} stage0 {t['stage0'] * 1e3:7.2f} ms stage1 {t['stage1'] * 1e3:7.2f} ms "
                f"codec {t['codec'] * 1e3:6.2f} ms per microbatch; hop {t['hop_bytes'][0]} B fwd {t['hop_bytes'][1]} "
                "B bwd; "
                f"params {t['params']}",
                flush=True,
            )
        save(args.json, result)
        seeds = [int(s) for s in args.seeds.split(",")]
        longest = max(int(args.steps * (args.extend if c["k"] else 1)) for c in cfgs)
        jobs = [(c, s, int(args.steps * (args.extend if c["k"] else 1))) for s in seeds for c in cfgs]
        # Seed by seed (a run cut short by --deadline-s keeps whole seeds), the target's run first, then the longest.
        jobs.sort(key=lambda j: (j[1], j[0]["key"] != "dense:bf16", -j[2]))
        pool = ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn"))
        futures = {pool.submit(train_run, args, c, s, n, longest): (c, s) for c, s, n in jobs}
        remaining = (args.deadline_s - (time.perf_counter() - t0)) if args.deadline_s else None
        try:
            for future in as_completed(futures, timeout=remaining):
                c, s = futures[future]
                try:
                    run = future.result()
                except Exception as exc:  # noqa: BLE001 - a failed run is reported, the rest go on
                    print(f"  run {c['name']} seed {s} failed: {exc!r}", flush=True)
                    result.setdefault("failed", []).append({"config": c["key"], "seed": s, "error": repr(exc)})
                    continue
                result["runs"].append(run)
                last = run["curve"][-1]
                print(
                    f"  [{time.perf_counter() - t0:6.0f}s] {c['name']:22s} seed {s}: {run['steps']} steps in "
                    f"{run['seconds']:.0f}s, held-out {run['curve'][0]['held_out']:.3f} -> {last['held_out']:.4f}",
                    flush=True,
                )
                save(args.json, result)
        except TimeoutError:
            for process in list(pool._processes.values()):  # our own workers, by handle
                process.terminate()
            left = [(c, s) for f, (c, s) in futures.items() if not f.done()]
            result["cut_by_deadline"] = [f"{c['key']}/{s}" for c, s in left]
            print(f"  deadline of {args.deadline_s:.0f}s reached: {len(left)} runs not finished", flush=True)
            for c, s in left:  # keep the curve each cut run had reached
                partial = part_path(args, c, s) if args.json else None
                if partial and partial.exists():
                    run = json.loads(partial.read_text())
                    result["runs"].append(run)
                    print(
                        f"    cut: {c['name']:22s} seed {s} at step {run['cut_at_step']} of {run['steps']}, held-out "
                        f"{run['curve'][-1]['held_out']:.4f}",
                        flush=True,
                    )
            save(args.json, result)
        pool.shutdown(wait=False, cancel_futures=True)
        if args.json:  # the curves so far are in the JSON now
            shutil.rmtree(Path(args.json).with_suffix(".parts"), ignore_errors=True)
    result["_llama"], result["_ranges"] = llama, ranges
    summary = summarise(result, links, fractions)
    print_tables(result, summary, links)
    result["summary"] = summary
    save(out if reprinting else args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
