"""`noloco-node experiment`: a grid of local swarms behind emulated WAN links (method x replicas x
stages x network profile x seed), with validation loss, outer-sync time vs N, bytes, replica
spread vs learning rate and idle time, written as CSV, PNG plots and report.md.
The reproduction scenarios are in examples/ (convergence, routing, scaling, gamma_codec, loss_price).
A seed fixes the initial weights and the data; the outer rounds' pairings depend on timing, so two
runs of one seed differ too."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "experiment", help="run a WAN latency experiment grid and write a report", description=__doc__
    )
    p.add_argument("scenario", nargs="?", help="scenario TOML (default: built-in defaults)")
    p.add_argument(
        "--out", default="runs/experiment", help="output folder (default runs/experiment); refused if it holds a run"
    )
    p.add_argument("--overwrite", action="store_true", help="replace the run --out holds (its files only)")
    p.add_argument("--methods", nargs="+", choices=["noloco", "diloco", "dp", "none"], help="override scenario.methods")
    p.add_argument("--steps", type=int, help="override scenario.steps")
    p.add_argument("--seeds", type=int, nargs="+", help="override scenario.seeds")
    p.add_argument("--outer-sync-sizes", type=int, nargs="+", help="override scenario.outer_sync_sizes")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from noloco_node.experiments.scenario import load_scenario

    flags = {
        "methods": args.methods,
        "steps": args.steps,
        "seeds": args.seeds,
        "outer_sync_sizes": args.outer_sync_sizes,
    }
    scenario = load_scenario(args.scenario, **flags)
    given = [
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in flags.items() if v
    ]
    if given and args.scenario:  # the report's title names the grid that ran, not only the file's
        scenario = dataclasses.replace(scenario, name=f"{scenario.name} (run with {' '.join(given)})")
    from noloco_node.experiments.runner import run_experiment

    command = (
        "noloco-node " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        if sys.argv[1:2] == ["experiment"]
        else f"noloco-node experiment {args.scenario or ''} --out {args.out}"
    )
    if "--overwrite" not in command.split():  # the report's Reproduce line runs where this run's folder now is
        command += " --overwrite"
    from noloco_node.experiments.process_group import Interrupted, raise_on_signals

    # A stop signal unwinds through the running cell's `finally`: its swarm and relay are stopped.
    try:
        with raise_on_signals():
            result = run_experiment(scenario, Path(args.out), command, overwrite=args.overwrite)
    except Interrupted as stop:
        print(f"noloco-node experiment: stopped by {stop}; the running cell's swarm was stopped", file=sys.stderr)
        return stop.exit_code
    failed = [r["cell"] for r in result["cells"] if r["status"] != "ok"]
    if failed:
        print(f"noloco-node: {len(failed)} cell(s) failed: {', '.join(failed)} (see the report)", file=sys.stderr)
        return 1
    return 0
