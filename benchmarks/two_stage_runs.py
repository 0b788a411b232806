"""Shared by pipeline_throughput.py and model_scale.py: one model trained as P=2 stages x 1
replica over gRPC (one torch thread per process) and the same model in one process with the same
total threads (two), on the same data. Not a benchmark by itself."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from safetensors.torch import load_file

from noloco_node.data.loader import PackedSequences
from noloco_node.experiments.launcher import LocalSwarm
from noloco_node.experiments.process_group import raise_on_signals
from noloco_node.model.build import build_run_stage, run_model
from noloco_node.model.stage import LlamaStage
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule


def peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident memory (VmHWM), or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class OneProcessModel:
    """The run's P stages, one replica, chained in this process: each stage with its own inner
    optimizer (per-stage clipping, as a node), the boundaries plain autograd."""

    def __init__(self, config, vocab_size: int) -> None:
        inner = config.inner
        llama, ranges = run_model(config, vocab_size)
        self.stages = [build_run_stage(config, llama, ranges, s) for s in range(config.pipeline.num_stages)]
        schedule = InnerSchedule(
            lr_max=inner.lr,
            warmup_steps=inner.warmup_steps,
            total_steps=inner.total_steps,
            min_lr_ratio=inner.min_lr_ratio,
        )
        self.optimizers = [
            InnerOptimizer(
                stage.parameters(),
                schedule,
                betas=(inner.beta1, inner.beta2),
                eps=inner.eps,
                weight_decay=inner.weight_decay,
                clip_norm=inner.clip_norm,
            )
            for stage in self.stages
        ]
        self.microbatch = config.pipeline.microbatch_size

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = inputs
        for stage in self.stages:
            x = stage(x, inputs)  # the token ids: a residual-subspace stage rebuilds from them
        return LlamaStage.loss(x, labels)

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """One inner step on a [B, T] batch, in microbatches; returns the mean microbatch loss."""
        losses, size = [], inputs.shape[0]
        for start in range(0, size, self.microbatch):
            loss = self.loss(inputs[start : start + self.microbatch], labels[start : start + self.microbatch])
            (loss * (min(self.microbatch, size - start) / size)).backward()
            losses.append(loss.item())
        for optimizer in self.optimizers:
            optimizer.step()
        return sum(losses) / len(losses)

    @torch.no_grad()
    def validation_loss(self, batches) -> float:
        losses = [float(self.loss(inputs, labels)) for inputs, labels in batches]
        return sum(losses) / len(losses)


def steadiness(first: float, again: float) -> tuple[float, str]:
    """The one-process baseline measured before and after what it is compared with: their mean,
    and a line saying how far apart they were, with a warning past 20% (a researcher's audit read
    ratios of 15.7 and 0.50 from two back-to-back runs on a machine other work was loading)."""
    mean = (first + again) / 2
    spread = abs(first - again) / mean if mean else 0.0
    load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    line = (
        f"one process again:                   {again:9.1f} tokens/s ({spread:.0%} from the first; ratios use "
        f"their mean, {mean:.1f}; load average {load:.1f} on {cores} cores)"
    )
    if spread > 0.2:
        line += (
            "\nWARNING: this machine's speed moved by more than 20% during the run (other work on it?): "
            "the ratios are not reliable; run again on an idle machine"
        )
    return mean, line


def one_process(
    config, corpus, tokenizer, args, on_trained: Callable[[OneProcessModel], None] | None = None
) -> tuple[float, float | None]:
    """(tokens/s over args.steps after args.warmup steps, this process's peak RSS in MB);
    `on_trained` is handed the trained model (to evaluate it)."""
    torch.set_num_threads(2)
    sim = OneProcessModel(config, len(tokenizer))
    batches = PackedSequences(
        corpus, tokenizer, seq_len=args.seq_len, holdout_fraction=config.data.holdout_fraction, shuffle_buffer=0
    ).batches(args.batch)
    for _ in range(args.warmup):
        sim.train_step(*next(batches))
    start = time.perf_counter()
    for _ in range(args.steps):
        sim.train_step(*next(batches))
    tok_s = args.steps * args.batch * args.seq_len / (time.perf_counter() - start)
    if on_trained is not None:
        on_trained(sim)
    return tok_s, peak_rss_mb(os.getpid())


def held_out_batches(
    config, corpus, tokenizer, *, seq_len: int, batch: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `count` batches of the corpus's held-out split (data.holdout_fraction), which no
    node trains on."""
    batches = PackedSequences(
        corpus, tokenizer, seq_len=seq_len, split="validation", holdout_fraction=config.data.holdout_fraction
    ).batches(batch)
    return [b for _, b in zip(range(count), batches)]


def held_out_loss(config, tokenizer, weight_files: list[Path], batches) -> float:
    """The mean loss on `batches` of the model the stages' saved weights make up, one file per stage."""
    sim = OneProcessModel(config, len(tokenizer))
    for stage, path in zip(sim.stages, weight_files):
        stage.load_state_dict(load_file(str(path)))
    return sim.validation_loss(batches)


def two_stage_swarm(sets: list[str], args, out: Path, timeout_s: float = 3600) -> dict:
    """P = 2 x 1: see staged_swarm."""
    return staged_swarm(sets, args, out, 2, timeout_s)


def staged_swarm(
    sets: list[str], args, out: Path, num_stages: int, timeout_s: float = 3600, save_weights: bool = False
) -> dict:
    """P stages x 1 replica: tokens/s (from stage 0's step timestamps, start-up excluded), each
    stage's peak RSS, the stage-0 node's payload bytes per forward sent, the mean loss of the last
    step's microbatches, the schedule's measured staleness and, with save_weights, each stage's
    final weights file ("weights", stage order)."""
    save = ("--save-weights",) if save_weights else ()
    # SIGTERM too unwinds through LocalSwarm.__exit__, so a killed benchmark leaves no nodes behind.
    with (
        raise_on_signals(),
        LocalSwarm(out, overrides=sets + [f"pipeline.num_stages={num_stages}"], threads=1) as local,
    ):
        local.start_bootstrap()
        servers = [local.start_node(stage, 0, *save) for stage in range(1, num_stages)]
        local.wait_ready(servers)
        driver = local.start_node(0, 0, "--steps", str(args.steps + args.warmup), *save)
        nodes = [driver] + servers
        deadline = time.monotonic() + timeout_s
        rss: dict[int, float | None] = {stage: None for stage in range(num_stages)}
        while driver.proc.poll() is None and time.monotonic() < deadline:
            for stage, node in enumerate(nodes):
                rss[stage] = peak_rss_mb(node.proc.pid) or rss[stage]
            time.sleep(1.0)
        if driver.proc.returncode != 0:
            raise RuntimeError(driver.log_file.read_text()[-2000:])
        for stage, node in enumerate(nodes[1:], start=1):
            rss[stage] = peak_rss_mb(node.proc.pid) or rss[stage]
        local.stop()
        stats = {s["stage"]: s for s in local.node_stats().values()}
    times = stats[0]["step_times"]
    weights = (
        [
            next(
                p
                for p in (out / "nodes").glob(f"stage{stage}-*.safetensors")
                if not p.name.endswith(".outer.safetensors")
            )
            for stage in range(num_stages)
        ]
        if save_weights
        else []
    )
    return {
        "tok_s": args.steps * args.batch * args.seq_len / (times[-1] - times[args.warmup - 1]),
        "peak_rss_mb": rss,
        "bytes_per_hop": stats[0]["bytes_sent"] / max(1, stats[0]["forwards_sent"]),
        "final_loss": stats[0]["step_losses"][-1],
        "schedule": stats[0]["schedule"],
        "weights": weights,
    }
