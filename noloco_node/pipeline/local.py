"""D replicas x P stages in one process: the algorithm without the network.

Each microbatch takes a uniformly random replica at every stage boundary (as the swarm will),
every replica steps its own Adam, and every H inner steps the replicas of each stage take the
outer step of the configured method: `noloco` pairs them at random (an odd one out takes the solo
step) and exchanges snapshots through the real wire codec; `diloco` uses the mean over all
replicas; `dp` averages gradients every inner step; `none` never syncs. Stage boundaries are
detached leaves with gradients handed back by hand, exactly what a send/recv does.

This is the single-process reference the networked pipeline is checked against, and the
`noloco-node demo --local` job.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from noloco_node.codec.tensors import decode, encode
from noloco_node.config import NodeConfig
from noloco_node.model.build import build_run_stage, run_model
from noloco_node.model.stage import LlamaStage
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.optim.state import OuterState

log = logging.getLogger(__name__)


@dataclass
class Replica:
    stage: LlamaStage
    inner: InnerOptimizer
    outer: OuterState
    received: dict[int, int] = field(default_factory=dict)  # upstream replica -> forwards received


def wire_round_trip(snapshot: dict[str, tuple[Tensor | None, Tensor]], codec: str) -> dict[str, tuple[Tensor | None, Tensor]]:
    """The snapshot as the partner would decode it from the wire."""
    def through(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        spec, payload = encode(t, codec)
        return decode(spec, payload)
    return {name: (through(phi), through(theta)) for name, (phi, theta) in snapshot.items()}


class LocalSimulation:
    """Train D replicas of a P-stage model in this process; see the module docstring."""

    def __init__(self, config: NodeConfig, *, num_replicas: int, vocab_size: int, seed: int | None = None) -> None:
        self.config, self.num_replicas = config, num_replicas
        self.num_stages = config.pipeline.num_stages
        self.rng = random.Random(config.run.seed if seed is None else seed)
        inner = config.inner
        self.llama, ranges = run_model(config, vocab_size)
        schedule = InnerSchedule(lr_max=inner.lr, warmup_steps=inner.warmup_steps, total_steps=inner.total_steps,
                                 min_lr_ratio=inner.min_lr_ratio)
        outer = config.outer
        self.replicas: list[list[Replica]] = []
        for s in range(self.num_stages):
            row = []
            for _ in range(num_replicas):
                stage = build_run_stage(config, self.llama, ranges, s)
                row.append(Replica(
                    stage=stage,
                    inner=InnerOptimizer(stage.parameters(), schedule, betas=(inner.beta1, inner.beta2), eps=inner.eps,
                                         weight_decay=inner.weight_decay, clip_norm=inner.clip_norm),
                    outer=OuterState(stage.named_parameters(), alpha=outer.alpha, beta=outer.beta, gamma=outer.gamma),
                ))
            self.replicas.append(row)
        self.inner_steps = 0
        self.outer_rounds = {"paired": 0, "solo": 0}
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def _microbatch(self, origin: int, inputs: Tensor, labels: Tensor, scale: float) -> float:
        """Forward along a random route, backward along the same route; returns the loss."""
        route = [origin] + [self.rng.randrange(self.num_replicas) for _ in range(self.num_stages - 1)]
        for s in range(1, self.num_stages):
            received = self.replicas[s][route[s]].received
            received[route[s - 1]] = received.get(route[s - 1], 0) + 1
        boundary, outputs, x = [], [], inputs
        for s, d in enumerate(route):
            if s > 0:
                x = x.detach().requires_grad_()
            boundary.append(x)
            x = self.replicas[s][d].stage(x, inputs)  # the token ids: a residual-subspace stage rebuilds from them
            outputs.append(x)
        loss = LlamaStage.loss(x, labels)
        (loss * scale).backward()
        loss = loss.detach()
        for s in range(self.num_stages - 1, 0, -1):
            outputs[s - 1].backward(boundary[s].grad)
        return loss.item()

    def train_step(self, batches: list[tuple[Tensor, Tensor]]) -> float:
        """One inner step: every stage-0 replica d consumes batches[d] ([B, T] inputs, labels)."""
        micro = self.config.pipeline.microbatch_size
        step_losses = []
        for origin, (inputs, labels) in enumerate(batches):
            scale = micro / inputs.shape[0]
            for start in range(0, inputs.shape[0], micro):
                step_losses.append(self._microbatch(origin, inputs[start:start + micro], labels[start:start + micro], scale))
        if self.config.outer.method == "dp":
            self._average_gradients()
        for row in self.replicas:
            for replica in row:
                lr, _ = replica.inner.step()
        self.inner_steps += 1
        self.lrs.append(lr)
        loss = sum(step_losses) / len(step_losses)
        self.losses.append(loss)
        if self.inner_steps % self.config.outer.inner_steps_per_outer == 0:
            self._outer_step()
        return loss

    def _average_gradients(self) -> None:
        for row in self.replicas:
            params = [list(r.stage.parameters()) for r in row]
            for group in zip(*params):
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
                mean = torch.stack(grads).mean(0)
                for p in group:
                    p.grad = mean.clone()

    def _outer_step(self) -> None:
        method = self.config.outer.method
        if method in ("dp", "none"):
            return
        for row in self.replicas:
            if method == "diloco":
                mean = {n: torch.stack([r.outer.params[n].detach() for r in row]).mean(0) for n in row[0].outer.params}
                for r in row:
                    r.outer.apply_diloco(mean)
                continue
            order = list(range(len(row)))
            self.rng.shuffle(order)
            snapshots = {d: row[d].outer.snapshot() for d in order}
            wire = {d: wire_round_trip(snapshots[d], self.config.outer.codec) for d in order}
            for i in range(0, len(order) - 1, 2):
                a, b = order[i], order[i + 1]
                own_a = {n: theta for n, (_, theta) in wire[a].items()}
                own_b = {n: theta for n, (_, theta) in wire[b].items()}
                row[a].outer.apply_noloco([wire[b]], own=own_a)
                row[b].outer.apply_noloco([wire[a]], own=own_b)
                self.outer_rounds["paired"] += 2
            if len(order) % 2:
                row[order[-1]].outer.apply_noloco([])
                self.outer_rounds["solo"] += 1

    def replica_spread(self) -> float:
        """RMS deviation of each replica's weights from the replica mean, over all parameters."""
        total, count = 0.0, 0
        with torch.no_grad():
            for row in self.replicas:
                for group in zip(*[list(r.stage.parameters()) for r in row]):
                    stacked = torch.stack([p.detach().double() for p in group])
                    total += float((stacked - stacked.mean(0)).pow(2).sum())
                    count += stacked.numel()
        return math.sqrt(total / count)

    @torch.no_grad()
    def validation_loss(self, batches: list[tuple[Tensor, Tensor]]) -> float:
        """Ensemble mean loss: column d evaluated with fixed routing (stage s replica d)."""
        losses = []
        for d in range(self.num_replicas):
            for inputs, labels in batches:
                x = inputs
                for s in range(self.num_stages):
                    x = self.replicas[s][d].stage(x, inputs)
                losses.append(float(LlamaStage.loss(x, labels)))
        return sum(losses) / len(losses)

    def routes(self) -> dict[str, dict[str, int]]:
        return {f"stage{s}/replica{d}": {f"replica{u}": n for u, n in sorted(r.received.items())}
                for s in range(1, self.num_stages) for d, r in enumerate(self.replicas[s])}


def run_local(config: NodeConfig, *, num_replicas: int, steps: int, corpus, tokenizer,
              num_val_batches: int = 4, progress=None) -> dict:
    """Train for `steps` inner steps and return a summary dict (losses, spread, routes, timing)."""
    from noloco_node.data.loader import PackedSequences, ShardSpec

    torch.manual_seed(config.run.seed)
    sim = LocalSimulation(config, num_replicas=num_replicas, vocab_size=len(tokenizer))
    B, T = config.pipeline.batch_size, config.model.seq_len
    streams = [PackedSequences(corpus, tokenizer, seq_len=T, shard=ShardSpec(shard_index=d, num_shards=num_replicas),
                               holdout_fraction=config.data.holdout_fraction, seed=config.run.seed + d).batches(B)
               for d in range(num_replicas)]
    val = PackedSequences(corpus, tokenizer, seq_len=T, split="validation", holdout_fraction=config.data.holdout_fraction)
    val_batches = []
    for batch in val.batches(B):
        val_batches.append(batch)
        if len(val_batches) >= num_val_batches:
            break
    val_first = sim.validation_loss(val_batches) if val_batches else float("nan")
    start = time.monotonic()
    for step in range(steps):
        loss = sim.train_step([next(s) for s in streams])
        if progress is not None:
            progress(step + 1, steps, loss)
    elapsed = time.monotonic() - start
    tenth = max(1, steps // 10)
    return {
        "mode": "local", "method": config.outer.method, "stages": sim.num_stages, "replicas": num_replicas,
        "inner_steps": sim.inner_steps, "tokens": steps * num_replicas * B * T,
        "tokens_per_s": steps * num_replicas * B * T / elapsed if elapsed > 0 else None, "wall_s": elapsed,
        "loss_first": sum(sim.losses[:tenth]) / tenth, "loss_last": sum(sim.losses[-tenth:]) / tenth,
        "val_loss_first": val_first, "val_loss_last": sim.validation_loss(val_batches) if val_batches else float("nan"),
        "outer": sim.outer_rounds, "replica_spread_last": sim.replica_spread(), "routes": sim.routes(),
        "losses": sim.losses, "lrs": sim.lrs,
    }
