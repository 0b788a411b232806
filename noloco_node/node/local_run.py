"""`noloco-node demo --local`: the in-process swarm (node/in_process.py) trains D replicas x P
stages on one event loop, every node assembled as a process node is, and returns the summary
the demo writes (the keys of experiments/summary.py's, with mode "local")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from noloco_node.config import NodeConfig
from noloco_node.data.loader import PackedSequences
from noloco_node.node.in_process import InProcessNode, InProcessSwarm

Progress = Callable[[int, int, float], None]
"""(inner step, steps, that step's loss on replica 0)"""


def run_in_process(
    config: NodeConfig,
    *,
    replicas: int,
    steps: int,
    timeout_s: float = 1800.0,
    num_val_batches: int = 4,
    progress: Progress | None = None,
) -> dict:
    """Train for `steps` inner steps and return a summary dict (losses, spread, routes, timing)."""
    return asyncio.run(_run(config, replicas, steps, timeout_s, num_val_batches, progress))


async def _run(
    config: NodeConfig, replicas: int, steps: int, timeout_s: float, num_val_batches: int, progress: Progress | None
) -> dict:
    torch.manual_seed(config.run.seed)
    swarm = await InProcessSwarm(config, replicas=replicas).start()
    B, T = config.pipeline.batch_size, config.model.seq_len
    held_out = PackedSequences(
        swarm.corpus, swarm.tokenizer, seq_len=T, split="validation", holdout_fraction=config.data.holdout_fraction
    ).batches(B)
    val_batches = [batch for _, batch in zip(range(num_val_batches), held_out)]

    def on_inner_step(node: InProcessNode, step: int) -> None:
        if progress is not None and node.replica == 0:
            losses = node.driver.log.step_losses
            progress(step, steps, losses[-1] if losses else float("nan"))

    try:
        val_first = swarm.validation_loss(val_batches) if val_batches else float("nan")
        start = time.monotonic()
        await swarm.train(steps, timeout_s, on_inner_step)
        elapsed = time.monotonic() - start
    finally:
        await swarm.stop()
    return _summary(
        swarm, steps, elapsed, val_first, swarm.validation_loss(val_batches) if val_batches else float("nan")
    )


def _summary(swarm: InProcessSwarm, steps: int, elapsed: float, val_first: float, val_last: float) -> dict:
    config, drivers = swarm.config, [n.driver for n in swarm.stage(0)]
    # One loss per inner step: the mean over the stage-0 replicas of each one's step loss.
    losses = [sum(step) / len(step) for step in zip(*(d.log.step_losses for d in drivers))]
    tenth = max(1, len(losses) // 10)
    tokens = steps * swarm.replicas * config.pipeline.batch_size * config.model.seq_len
    microbatches = {
        k: sum(d.counters.as_dict()[k] for d in drivers) for k in ("issued", "completed", "reissued", "dropped")
    }
    return {
        "mode": "local",
        "method": config.outer.method,
        "stages": config.pipeline.num_stages,
        "replicas": swarm.replicas,
        "inner_steps": min(n.worker.inner_steps for n in swarm.nodes),
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "wall_s": elapsed,
        "loss_first": sum(losses[:tenth]) / tenth,
        "loss_last": sum(losses[-tenth:]) / tenth,
        "val_loss_first": val_first,
        "val_loss_last": val_last,
        "microbatches": microbatches,
        "outer": swarm.outer_rounds(),
        "replica_spread_last": swarm.replica_spread(),
        "routes": swarm.routes(),
        "losses": losses,
        "lrs": list(drivers[0].log.lrs) if drivers else [],
    }
