"""`noloco-node demo`: a local swarm on 127.0.0.1 (a bootstrap peer and D replicas x P stages as
separate processes) trains a tiny Llama on the embedded corpus and writes `--out/summary.json`.
`--local` runs the same swarm in one process instead: every node assembled as a process node is,
over in-memory ports (node/in_process.py)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from noloco_node.cli.common import add_config_flags, resolve_config
from noloco_node.cli.demo_report import report_lines
from noloco_node.experiments.process_group import Interrupted, raise_on_signals

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="train a tiny model on a local swarm and write a summary", description=__doc__
    )
    add_config_flags(p)
    p.add_argument("--steps", type=int, default=40, help="inner steps (default 40)")
    p.add_argument("--stages", type=int, help="pipeline stages P (default 2)")
    p.add_argument("--replicas", type=int, default=2, help="replicas per stage D (default 2)")
    p.add_argument("--method", choices=["noloco", "diloco", "dp", "none"], help="outer method (default noloco)")
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--local", action="store_true", help="run all replicas and stages in this process")
    p.add_argument("--timeout", type=float, default=1800, help="give up on the swarm after this many seconds")
    p.add_argument(
        "--dashboard",
        default="0",
        metavar="[HOST:]PORT",
        help="the swarm's live web page, served by the "
        "bootstrap (default: a free port on 127.0.0.1, printed at start; 'off' for none)",
    )
    p.set_defaults(run=run)


def demo_defaults(steps: int) -> dict[str, dict]:
    """Settings that make a CPU demo learn visibly in a minute or two; a config file or --set wins."""
    return {
        "pipeline": {"batch_size": 8, "microbatch_size": 4},
        "inner": {"lr": 3e-3, "warmup_steps": max(1, steps // 10), "total_steps": max(1, steps)},
        "outer": {"inner_steps_per_outer": 10},
        "timeouts": {"match_s": 3.0},
    }


def _prepare_tokenizer(config) -> int:
    """Train/cache the tokenizer once here so node processes only load it."""
    from noloco_node.data.corpus import resolve_corpus
    from noloco_node.data.tokenizer import load_tokenizer

    corpus = resolve_corpus(config.data.path, cache_dir=config.data.cache_path, text_field=config.data.text_field)
    return len(
        load_tokenizer(
            config.data.tokenizer, corpus, vocab_size=config.data.vocab_size, cache_dir=config.data.cache_path
        )
    )


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.replicas < 1 or (args.stages is not None and args.stages < 1):
        print("noloco-node demo: --steps, --replicas and --stages must be whole numbers >= 1", file=sys.stderr)
        return 2
    # SIGTERM/SIGINT/SIGHUP, from start-up on, unwind through the swarm's `with`: its nodes get
    # SIGTERM and drain, then whatever is left of its process group is killed.
    try:
        with raise_on_signals():
            return _run(args)
    except Interrupted as stop:
        from noloco_node.runtime.logging import ProgressLine

        ProgressLine().close()  # end a half-written progress line on a terminal
        print(f"noloco-node demo: stopped by {stop}; the local swarm was stopped", file=sys.stderr)
        return stop.exit_code


def _run(args: argparse.Namespace) -> int:
    flags = {"pipeline": {"num_stages": args.stages}, "outer": {"method": args.method}}
    base = demo_defaults(args.steps)
    base["outer"]["allreduce_group_size"] = args.replicas  # the demo knows how many replicas it starts
    config = resolve_config(args, base=base, flags=flags)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = _run_local(config, args) if args.local else _run_swarm(config, args, out)
    summary["config"] = config.to_dict()
    if not args.local:
        summary.update(_keep_the_model(config, out))
    from noloco_node.cli.bootstrap import typed_program

    for line in report_lines(summary, typed_program(sys.argv[0])):  # lines to copy: as the user typed it
        print(line)
    if summary.get("outer") is not None:
        warning = _outer_warning(summary["outer"], summary["method"], summary["replicas"])
        if warning:
            summary["warnings"] = [warning]
            print(f"warning: {warning}", file=sys.stderr)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'summary.json'}")
    return 0


def _keep_the_model(config, out: Path) -> dict:
    """The run's config as `out/config.toml` and the trained model (phi of the replica furthest on,
    from the nodes' saved weights) as a Hugging Face model directory `out/model`: what a newcomer
    wants at the end, and the config `export`/`eval --config` need for it."""
    from noloco_node.config.dump import to_toml
    from noloco_node.node.export import ExportError, check_out_dir, write_run_model
    from noloco_node.node.export_sources import weights_from_checkpoints
    from noloco_node.node.manifest import load_run_inputs

    config_file = out / "config.toml"
    sections = {k: v for k, v in config.to_dict().items() if k != "network"}
    config_file.write_text(to_toml(sections, header=f"The config of the `noloco-node demo` run in {out}."))
    _, tokenizer, manifest_hash = load_run_inputs(config)
    try:
        check_out_dir(out / "model", overwrite=True)
        logging.getLogger("noloco_node.node.export").setLevel(logging.WARNING)  # its file lines: the demo's noise
        weights, _ = weights_from_checkpoints([out / "nodes"], config, manifest_hash)
        model = write_run_model(config, weights, tokenizer, out / "model")
    except ExportError as exc:
        print(f"warning: the trained model was not written: {exc}", file=sys.stderr)
        return {"config_file": str(config_file), "model": None}
    return {"config_file": str(config_file), "model": str(model)}


def _outer_warning(outer: dict, method: str, replicas: int) -> str | None:
    """A demo whose outer steps never averaged anything did not show the method; say so and why."""
    rounds, solo = outer.get("rounds", 0), outer.get("solo", 0)
    if method not in ("noloco", "diloco") or not rounds or 2 * solo <= rounds:
        return None
    what = f"all {rounds} outer rounds went solo" if solo == rounds else f"{solo} of {rounds} outer rounds went solo"
    if replicas < 2:
        return f"{what}: with --replicas 1 there is no replica to average with"
    return (
        f"{what}: replicas did not find a partner within timeouts.match_s (a loaded machine); rerun with "
        f"--set timeouts.match_s=10 or fewer --replicas"
    )


def _run_local(config, args) -> dict:
    from noloco_node.node.local_run import run_in_process
    from noloco_node.runtime.logging import ProgressLine

    progress = ProgressLine()
    summary = run_in_process(
        config,
        replicas=args.replicas,
        steps=args.steps,
        timeout_s=args.timeout,
        progress=lambda i, n, loss: progress.update(f"step {i}/{n}  loss {loss:.3f}"),
    )
    progress.close()
    return summary


def _run_swarm(config, args, out: Path) -> dict:
    from noloco_node.experiments.launcher import LocalSwarm
    from noloco_node.experiments.summary import summarize_swarm
    from noloco_node.runtime.logging import ProgressLine

    _prepare_tokenizer(config)
    stages, replicas = config.pipeline.num_stages, args.replicas
    threads = max(1, (os.cpu_count() or 1) // (stages * replicas))
    overrides = [
        f"{section}.{name}={_flat(value)}"
        for section, fields in config.to_dict().items()
        for name, value in fields.items()
        if section not in ("network",) and value is not None and not (section == "pipeline" and name == "stage")
    ]
    for stale in (
        [*(out / "nodes").glob("*.json"), *(out / "nodes").glob("*.safetensors")] if (out / "nodes").exists() else []
    ):
        stale.unlink()
    progress = ProgressLine()
    start = time.monotonic()
    # D nodes of a stage start at once, each importing torch and building its model on the same cores.
    startup_s = config.timeouts.startup_s + 30 + 10 * replicas
    with LocalSwarm(out, overrides=overrides, threads=threads, startup_timeout_s=startup_s) as swarm:
        print(
            f"starting a local swarm on 127.0.0.1: a bootstrap peer and {replicas} replicas x {stages} stages, "
            f"each its own process; their logs are in {out / 'logs'}",
            flush=True,
        )
        swarm.start_bootstrap(*(("--dashboard", args.dashboard) if args.dashboard != "off" else ()))
        if args.dashboard != "off":
            print(f"watch the swarm live: {swarm.dashboard_url()}", flush=True)
        drivers = _start_nodes(swarm, stages, replicas, args.steps, progress, start)
        print(f"the swarm is up after {time.monotonic() - start:.0f} s; training {args.steps} inner steps", flush=True)
        _wait_for_training(drivers, args, out, progress, start)
        swarm.stop()
        return summarize_swarm(swarm, method=config.outer.method, steps=args.steps, wall_s=time.monotonic() - start)


def _start_nodes(swarm, stages: int, replicas: int, steps: int, progress, start: float) -> list:
    """The servers of stages 1.., then the stage-0 drivers; the progress line says who is not up yet
    (every node imports torch and builds its model on the same cores: a minute on 2 of them)."""

    def starting(waiting) -> None:
        up = sum(node.ready_file.exists() for node in swarm.nodes)
        names = ", ".join(node.label for node in waiting[:2]) + (" ..." if len(waiting) > 2 else "")
        progress.update(
            f"starting the swarm: {up}/{stages * replicas} nodes up, waiting for {names} "
            f"({time.monotonic() - start:.0f} s)"
        )

    servers = [swarm.start_node(s, r, "--save-weights") for s in range(1, stages) for r in range(replicas)]
    swarm.wait_ready(servers, on_wait=starting)
    drivers = [
        swarm.start_node(0, r, "--steps", str(steps), "--wait-replicas", str(replicas), "--save-weights")
        for r in range(replicas)
    ]
    swarm.wait_ready(drivers, on_wait=starting)
    progress.clear()
    return drivers


def _wait_for_training(drivers: list, args, out: Path, progress, start: float) -> None:
    deadline = start + args.timeout
    while any(d.proc.poll() is None for d in drivers):
        steps = [json.loads(d.ready_file.read_text()).get("inner_step", 0) for d in drivers]
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"demo did not finish within {args.timeout:.0f} s (stage-0 inner steps {steps} of "
                f"{args.steps}); logs in {out / 'logs'}"
            )
        progress.update(f"inner steps {min(steps)}/{args.steps} ({time.monotonic() - start:.0f} s)")
        time.sleep(0.5)
    progress.close()
    failed = [d.label for d in drivers if d.proc.returncode != 0]
    if failed:
        raise RuntimeError(f"{', '.join(failed)} failed; see {out / 'logs'}")


def _flat(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)
