"""Merge the per-node stats files of a local swarm into one run summary."""

from __future__ import annotations

from noloco_node.experiments.launcher import LocalSwarm


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize_swarm(swarm: LocalSwarm, *, method: str, steps: int, wall_s: float) -> dict:
    stats = swarm.node_stats()
    labels = {n.info.get("peer_id"): n.label for n in swarm.nodes if n.info}
    drivers = [s for s in stats.values() if s["stage"] == 0]
    counters = {k: sum(d.get("microbatches", {}).get(k, 0) for d in drivers) for k in ("issued", "completed", "reissued", "dropped")}
    firsts, lasts = [], []
    for d in drivers:
        losses = d.get("losses", [])
        tenth = max(1, len(losses) // 10)
        firsts += losses[:tenth]
        lasts += losses[-tenth:]
    routes = {}
    for peer_id, s in sorted(stats.items(), key=lambda kv: labels.get(kv[0], kv[0])):
        if s["stage"] > 0:
            routes[labels.get(peer_id, peer_id)] = {labels.get(up, up): n for up, n in sorted(s["forwards_received"].items())}
    tokens = sum(d["tokens"] for d in drivers)
    return {
        "mode": "swarm", "method": method, "stages": 1 + max(s["stage"] for s in stats.values()) if stats else 0,
        "replicas": len(drivers), "inner_steps": min((d["inner_steps"] for d in drivers), default=0),
        "requested_steps": steps, "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "loss_first": _mean(firsts), "loss_last": _mean(lasts), "microbatches": counters, "routes": routes,
        "nodes": {labels.get(p, p): {k: v for k, v in s.items() if k not in ("losses", "lrs", "step_times")}
                  for p, s in stats.items()},
    }
