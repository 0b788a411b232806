"""`noloco-node join`: serve one pipeline stage of a run (stage 0 also drives training)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path

from noloco_node.cli.common import add_config_flags, resolve_config, stop_on_signals
from noloco_node.runtime.files import atomic_write_text

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("join", help="serve a pipeline stage of a run", description=__doc__)
    add_config_flags(p)
    p.add_argument("--initial-peers", nargs="*", metavar="MADDR", help="DHT multiaddrs to bootstrap from")
    p.add_argument("--stage", type=_stage, help="the stage to serve, or 'auto': an empty stage, else the one whose replicas "
                   "sustain the least (measured capacity; fewest replicas until measured), whose state is then "
                   "fetched from a replica (pipeline.stage)")
    p.add_argument("--host", help="address to bind (network.host; 0.0.0.0 = every interface, announcing the address "
                   "peers observe)")
    p.add_argument("--port", type=int, help="gRPC port (network.port, 0 = any)")
    p.add_argument("--announce-addr", metavar="HOST:PORT", help="the address peers dial (network.announce_addr); "
                   "checked at join by asking live peers to call our health endpoint; behind NAT, leave it out: "
                   "the node is then reached over libp2p (hole punching or a relay)")
    p.add_argument("--events", metavar="FILE", help="append a JSONL event stream here (log.events_file)")
    p.add_argument("--steps", type=int, default=0, help="stage 0: train until inner step N, then leave (a node that "
                   "resumed from its checkpoint or fetched a replica's state runs only what is left; 0 = serve until stopped)")
    p.add_argument("--serve-after", action="store_true", help="stage 0 with --steps: keep serving after the last "
                   "step (phi for joiners and `export --initial-peers`) until stopped")
    p.add_argument("--wait-replicas", type=int, default=1, help="stage 0: wait until every stage has this many replicas")
    p.add_argument("--threads", type=int, help="torch threads for this process (default: all cores)")
    p.add_argument("--out", help="write this node's stats (and weights with --save-weights) here on exit")
    p.add_argument("--save-weights", action="store_true")
    p.add_argument("--ready-file", help="write {peer_id, address, stage, inner_step, in_flight} here once serving, "
                   "refreshed every 0.1 s (for launchers and tests)")
    p.add_argument("--snapshot-every", type=int, default=0, metavar="K",
                   help="experiments: save theta every K inner steps (and at start) under --snapshot-dir")
    p.add_argument("--snapshot-dir", help="where --snapshot-every writes stage{s}-{peer}-step{k}.safetensors")
    p.set_defaults(run=run)


def _stage(value: str) -> str:
    if value != "auto" and not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is neither a stage index nor 'auto'")
    return value


def run(args: argparse.Namespace) -> int:
    config = resolve_config(args, flags={
        "network": {"initial_peers": args.initial_peers, "host": args.host, "port": args.port,
                    "announce_addr": args.announce_addr},
        "pipeline": {"stage": args.stage},
        "log": {"events_file": args.events},
    })
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return asyncio.run(_serve(config, args))


async def _serve(config, args: argparse.Namespace) -> int:
    from noloco_node.node import Node
    from noloco_node.runtime.logging import setup_logging
    from noloco_node.node.reporting import TrainingLog, read_node

    stop = stop_on_signals()
    node = Node(config, out_dir=Path(args.out) if args.out else None, save_weights=args.save_weights)
    if args.snapshot_every:
        node.snapshot_every, node.snapshot_dir = args.snapshot_every, Path(args.snapshot_dir or "snapshots")
    await node.start()
    progress = _progress(config.log.progress)
    while True:
        setup_logging(logging.getLevelName(logging.getLogger().level), prefix=f"{node.peer_id[-6:]} s{node.stage_index}")
        maddrs = await node.directory.visible_maddrs()
        # The progress line shows the same on a terminal; without one, step lines go to the log instead.
        training = TrainingLog(config.log.every_steps if progress is None else 0,
                               total=args.steps if node.stage_index == 0 and args.steps > 0 else None)
        report = _reporter(node, training, args, maddrs)
        await report()
        # Always polled: stages > 0 have no per-step callback here, and their step lines come from it.
        reporter = asyncio.create_task(_report_periodically(node, report, progress))
        moving = False
        try:
            moving = await _serve_stage(node, args, stop, report)
        finally:
            reporter.cancel()
            if not moving:
                if progress is not None:
                    progress.close()
                try:
                    await node.stop()
                finally:  # after stop: bytes, drained and dropped microbatches are final
                    training.summary(read_node(node))
        if not moving:
            return 0
        node = await _move(node, config, args)


async def _serve_stage(node, args: argparse.Namespace, stop: asyncio.Event, report) -> bool:
    """Serve (and on stage 0 with --steps, train) until stopped, done, or a rebalancing move is
    planned for this node; True = move."""
    config = node.config
    if node.stage_index == 0 and args.steps > 0 and node.worker.inner_steps < args.steps:
        await _race(node.wait_for_replicas(args.wait_replicas, config.timeouts.startup_s), stop)
        if stop.is_set():
            return False
        # Until inner step N: a resumed node or one that fetched a replica's state starts past 0.
        if await _train_unless_moved(node, args.steps - node.worker.inner_steps, stop, report):
            return True
        if not args.serve_after or stop.is_set():
            return False
        await report()
    elif node.stage_index == 0 and args.steps > 0 and not args.serve_after:
        return False  # a node that moved onto stage 0 past inner step N has nothing left to train
    await _first(stop.wait(), node.move_requested.wait())
    return node.move_requested.is_set() and not stop.is_set()


async def _train_unless_moved(node, steps: int, stop: asyncio.Event, report) -> bool:
    """Train `steps` inner steps; stop cancels it, a planned move lets the step under way finish
    (no microbatch lost) and returns True."""
    training = asyncio.ensure_future(node.train(steps, on_inner_step=report))
    await _first(training, stop.wait(), node.move_requested.wait())
    if training.done():
        training.result()
        return False
    if stop.is_set() or node.driver is None:
        training.cancel()
        try:
            await training
        except asyncio.CancelledError:
            pass
        return False
    node.driver.request_stop()
    await training
    return True


async def _move(node, config, args: argparse.Namespace):
    """Leave this stage gracefully (withdraw, drain, no checkpoint of it) and come back on the
    planned one with the same identity; start() fetches the new stage's state from a replica."""
    from noloco_node.node import Node

    move = node.move
    log.info("moving: %s", move)
    await node.stop(final=False)
    record = {"from": move.source, "to": move.target, "at": time.time(), "inner_step": node.worker.inner_steps}
    if node.driver is not None:
        c = node.driver.counters
        record["microbatches"] = {"issued": c.issued, "completed": c.completed, "reissued": c.reissued, "dropped": c.dropped}
    moved = dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, stage=move.target, rebalance=True))
    new = Node(moved, out_dir=node.out_dir, save_weights=node.save_weights, identity=node.links.identity,
               moves=node.moves + [record])
    new.snapshot_every, new.snapshot_dir = node.snapshot_every, node.snapshot_dir
    await new.start()
    new.events.emit("moved", **record)
    log.info("moved to stage %d (state fetched: %s)", new.stage_index, new.fetched_state)
    return new


def _reporter(node, training, args: argparse.Namespace, maddrs):
    """The callback that logs step lines and refreshes --ready-file."""
    from noloco_node.node.reporting import read_node

    async def report(_step: int = 0) -> None:
        if training.due(node.worker.inner_steps):
            training.step(read_node(node))
        if args.ready_file:
            in_flight = [[k.origin, k.sequence, k.attempt] for k in list(node.runtime.in_flight)]
            atomic_write_text(args.ready_file, json.dumps({"peer_id": node.peer_id, "address": node.address, "stage": node.stage_index,
                                             "reach": node.links.reach, "tls_cert": node.links.certificate.b64,
                                             "p2p_addrs": node.links.p2p_addrs,
                                             "maddrs": maddrs, "inner_step": node.worker.inner_steps,
                                             "outer_round": node.outer_round, "status": node.status,
                                             "metrics_port": node.metrics_port,
                                             "in_flight": in_flight, "manifest_hash": node.manifest_hash,
                                             "saved_inputs": len(node.worker.saved), "moves": len(node.moves),
                                             "run_id": node.config.run.run_id}))

    return report


async def _report_periodically(node, report, progress) -> None:
    ticks = 0
    while True:
        await asyncio.sleep(0.1)
        await report()
        ticks += 1
        if progress is not None and ticks % 5 == 0:
            progress.update(_progress_text(node))


async def _first(*aws) -> None:
    """Wait until the first of `aws` finishes; cancel the rest (a task passed in is left running)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task, original in zip(tasks, aws):
        if task in pending and task is not original:
            task.cancel()


def _progress(mode: str):
    from noloco_node.runtime.logging import ProgressLine

    line = ProgressLine()
    line.enabled = mode == "on" or (mode == "auto" and line.enabled)
    return line if line.enabled else None


def _progress_text(node) -> str:
    stats = node.runtime.stats
    text = (f"stage {node.stage_index} | {node.status} | inner step {node.worker.inner_steps} | outer round "
            f"{node.outer_round} | {node.tokens_per_s:.0f} tok/s | "
            f"in flight {len(node.runtime.in_flight)} | sent {stats.forwards_sent} fwd {stats.backwards_sent} bwd")
    if node.driver is not None and node.driver.log.step_losses:
        text += f" | loss {node.driver.log.step_losses[-1]:.3f}"
    return text


async def _race(coro, stop: asyncio.Event) -> None:
    """Run `coro` until it finishes or `stop` is set (then cancel it)."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task not in done:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return
    task.result()
