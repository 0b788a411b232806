"""Merge the per-node stats files of a local swarm into one run summary."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from noloco_node.experiments.launcher import LocalSwarm


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def replica_spread(nodes_dir: Path) -> float | None:
    """RMS deviation of each replica's weights from the replica mean, over all parameters of all
    stages (docs/research.md, Experiments), from the weights the nodes saved on exit."""
    import torch
    from safetensors.torch import load_file

    by_stage: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(p for p in nodes_dir.glob("stage*.safetensors") if not p.name.endswith(".outer.safetensors")):
        by_stage[path.name.split("-")[0]].append(load_file(str(path)))
    if not by_stage or any(len(replicas) < 2 for replicas in by_stage.values()):
        return None
    total, count = 0.0, 0
    for replicas in by_stage.values():
        for name in replicas[0]:
            stacked = torch.stack([r[name].double() for r in replicas])
            total += float((stacked - stacked.mean(0)).pow(2).sum())
            count += stacked.numel()
    return math.sqrt(total / count)


def summarize_swarm(swarm: LocalSwarm, *, method: str, steps: int, wall_s: float) -> dict:
    stats = swarm.node_stats()
    labels = {n.info.get("peer_id"): n.label for n in swarm.nodes if n.info}
    drivers = [s for s in stats.values() if s["stage"] == 0]
    counters = {
        k: sum(d.get("microbatches", {}).get(k, 0) for d in drivers)
        for k in ("issued", "completed", "reissued", "dropped")
    }
    firsts, lasts = [], []
    for d in drivers:
        losses = d.get("losses", [])
        tenth = max(1, len(losses) // 10)
        firsts += losses[:tenth]
        lasts += losses[-tenth:]
    routes = {}
    for peer_id, s in sorted(stats.items(), key=lambda kv: labels.get(kv[0], kv[0])):
        if s["stage"] > 0:
            routes[labels.get(peer_id, peer_id)] = {
                labels.get(up, up): n for up, n in sorted(s["forwards_received"].items())
            }
    tokens = sum(d["tokens"] for d in drivers)
    outer = {
        k: sum(s.get("outer", {}).get(k, 0) for s in stats.values())
        for k in ("rounds", "paired", "solo", "rejected", "timed_out", "mixed_rounds", "partial_rounds")
    }
    return {
        "mode": "swarm",
        "method": method,
        "stages": 1 + max(s["stage"] for s in stats.values()) if stats else 0,
        "replicas": len(drivers),
        "inner_steps": min((d["inner_steps"] for d in drivers), default=0),
        "requested_steps": steps,
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "loss_first": _mean(firsts),
        "loss_last": _mean(lasts),
        "microbatches": counters,
        "routes": routes,
        "outer": outer,
        "bytes_sent_outer": {labels.get(p, p): s.get("bytes_sent_outer", 0) for p, s in stats.items()},
        "replica_spread_last": replica_spread(swarm.out_dir / "nodes"),
        "nodes": {
            labels.get(p, p): {k: v for k, v in s.items() if k not in ("losses", "lrs", "step_times")}
            for p, s in stats.items()
        },
    }
