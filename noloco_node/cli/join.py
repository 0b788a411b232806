"""`noloco-node join`: serve one pipeline stage of a run (stage 0 also drives training)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from pathlib import Path

from noloco_node.cli.common import add_config_flags, resolve_config, stop_on_signals

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("join", help="serve a pipeline stage of a run", description=__doc__)
    add_config_flags(p)
    p.add_argument("--initial-peers", nargs="*", metavar="MADDR", help="DHT multiaddrs to bootstrap from")
    p.add_argument("--stage", type=int, help="the stage to serve (pipeline.stage)")
    p.add_argument("--host", help="address to bind (network.host)")
    p.add_argument("--port", type=int, help="gRPC port (network.port, 0 = any)")
    p.add_argument("--steps", type=int, default=0, help="stage 0: train this many inner steps, then leave (0 = serve until stopped)")
    p.add_argument("--wait-replicas", type=int, default=1, help="stage 0: wait until every stage has this many replicas")
    p.add_argument("--threads", type=int, help="torch threads for this process (default: all cores)")
    p.add_argument("--out", help="write this node's stats (and weights with --save-weights) here on exit")
    p.add_argument("--save-weights", action="store_true")
    p.add_argument("--ready-file", help="write {peer_id, address, stage, inner_step, in_flight} here once serving, "
                   "refreshed every 0.1 s (for launchers and tests)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = resolve_config(args, flags={
        "network": {"initial_peers": args.initial_peers, "host": args.host, "port": args.port},
        "pipeline": {"stage": args.stage},
    })
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return asyncio.run(_serve(config, args))


async def _serve(config, args: argparse.Namespace) -> int:
    from noloco_node.node import Node
    from noloco_node.runtime.logging import setup_logging

    stop = stop_on_signals()
    node = Node(config, out_dir=Path(args.out) if args.out else None, save_weights=args.save_weights)
    await node.start()
    setup_logging(logging.getLevelName(logging.getLogger().level), prefix=f"{node.peer_id[-6:]} s{node.stage_index}")
    maddrs = await node.directory.visible_maddrs()

    async def report(_step: int = 0) -> None:
        if args.ready_file:
            in_flight = [[k.origin, k.sequence, k.attempt] for k in list(node.runtime.in_flight)]
            tmp = f"{args.ready_file}.tmp{os.getpid()}"
            Path(tmp).write_text(json.dumps({"peer_id": node.peer_id, "address": node.address, "stage": node.stage_index,
                                             "maddrs": maddrs, "inner_step": node.worker.inner_steps,
                                             "outer_round": node.outer_round, "status": node.status,
                                             "metrics_port": node.metrics_port,
                                             "in_flight": in_flight, "manifest_hash": node.manifest_hash,
                                             "run_id": config.run.run_id}))
            os.replace(tmp, args.ready_file)

    async def report_periodically() -> None:
        while True:
            await asyncio.sleep(0.1)
            await report()

    await report()
    reporter = asyncio.create_task(report_periodically()) if args.ready_file else None
    try:
        if node.stage_index == 0 and args.steps > 0:
            await _race(node.wait_for_replicas(args.wait_replicas, config.timeouts.startup_s), stop)
            if not stop.is_set():
                await _race(node.train(args.steps, on_inner_step=report), stop)
        else:
            await stop.wait()
    finally:
        if reporter is not None:
            reporter.cancel()
        await node.stop()
    return 0


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
