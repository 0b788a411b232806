"""A swarm of unequal volunteers: 2 stages x 3 replicas where two of stage 1's replicas are slowed
(faults.compute_delay_s on their compute thread, as a slower device). Two runs in the same
invocation on the same machine, each for the same wall time after every driver is ready:

- baseline: uniform routing (`pipeline.routing = random`, every replica an equal share) and the
  stages as the volunteers picked them (no rebalancing);
- aware: capacity-weighted routing and rebalancing (`pipeline.rebalance = true`), so stage 1's
  slow replicas get fewer microbatches and a stage-0 node may move to the limiting stage 1.

With `--routing-only` the aware run routes by capacity without rebalancing: the ratio is capacity
routing's alone (the integration test checks its shares, not its speed).

Prints the tokens/s each run completed (every driver's completed microbatches, a mover's from
before its move included, over the measured window) and the ratio aware / baseline.

    .venv/bin/python benchmarks/heterogeneous.py [--seconds 60] [--delay-s 0.02] [--routing-only] \
        [--out runs/bench-heterogeneous]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from noloco_node.experiments.launcher import LocalSwarm  # noqa: E402
from noloco_node.experiments.process_group import raise_on_signals  # noqa: E402


def overrides(out: Path, **extra) -> list[str]:
    from conftest import prepare_tokenizer, tiny_overrides  # the tests' tiny corpus and model

    sets = tiny_overrides(
        out,
        **{
            "outer.method": "noloco",
            "outer.inner_steps_per_outer": 10,
            "pipeline.batch_size": 4,
            "pipeline.microbatch_size": 1,
            "inner.total_steps": 100000,
            "timeouts.microbatch_s": 30.0,
            "timeouts.match_s": 2.0,
            **extra,
        },
    )
    prepare_tokenizer(sets)
    return sets


def run(out: Path, *, aware: bool, rebalance: bool, seconds: float, delay_s: float, period_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    sets = overrides(
        out,
        **{
            "pipeline.routing": "capacity" if aware else "random",
            "pipeline.rebalance": str(aware and rebalance).lower(),
            "pipeline.rebalance_period_s": period_s,
        },
    )
    with raise_on_signals(), LocalSwarm(out / "swarm", overrides=sets, threads=1) as swarm:
        swarm.start_bootstrap()
        servers = [swarm.start_node(1, 0)] + [
            swarm.start_node(1, r, "--set", f"faults.compute_delay_s={delay_s}") for r in (1, 2)
        ]
        swarm.wait_ready(servers)
        drivers = [swarm.start_node(0, r, "--steps", "100000", "--wait-replicas", "3") for r in range(3)]
        swarm.wait_ready(drivers)
        started = time.monotonic()
        time.sleep(seconds)
        window = time.monotonic() - started
        swarm.stop()
        stats = swarm.node_stats()
    completed, moves = 0, 0
    for s in stats.values():
        completed += s.get("microbatches", {}).get("completed", 0)
        for move in s.get("moves", []):
            moves += 1
            completed += move.get("microbatches", {}).get("completed", 0)
    seq_len = int(dict(o.split("=", 1) for o in sets)["model.seq_len"])
    stages = sorted(s["stage"] for s in stats.values())
    return {
        "tokens_per_s": completed * seq_len / window,
        "microbatches": completed,
        "window_s": round(window, 1),
        "moves": moves,
        "stages_at_end": stages,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="measured window per run")
    p.add_argument("--delay-s", type=float, default=0.02, help="extra compute seconds per pass on the slow replicas")
    p.add_argument("--period-s", type=float, default=5.0, help="pipeline.rebalance_period_s of the aware run")
    p.add_argument("--routing-only", action="store_true", help="aware run: capacity routing, no rebalancing")
    p.add_argument("--out", default="runs/bench-heterogeneous")
    args = p.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    results = {}
    for name, aware in (("baseline", False), ("aware", True)):
        results[name] = run(
            out / name,
            aware=aware,
            rebalance=not args.routing_only,
            seconds=args.seconds,
            delay_s=args.delay_s,
            period_s=args.period_s,
        )
        print(
            f"{name:8s}: {results[name]['tokens_per_s']:8.1f} tokens/s  ({results[name]['microbatches']} microbatches "
            f"in {results[name]['window_s']} s, moves {results[name]['moves']}, stages at end "
            f"{results[name]['stages_at_end']})",
            flush=True,
        )
    ratio = results["aware"]["tokens_per_s"] / results["baseline"]["tokens_per_s"]
    aware_is = "capacity routing" if args.routing_only else "capacity routing + rebalancing"
    print(
        f"aware ({aware_is}) / baseline = {ratio:.2f}x  (2 x 3 swarm, stage 1 has 2 replicas slowed by "
        f"{args.delay_s} s per pass)"
    )
    (out / "results.json").write_text(json.dumps({**results, "ratio": ratio, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
