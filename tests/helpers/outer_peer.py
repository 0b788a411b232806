"""A real peer that runs one NoLoCo outer round over a given state, as its own process.

It uses the product's parts unchanged (DHT directory, gRPC Outer service and client, NoLoCoSync,
OuterState) over a one-tensor "model" loaded from --state (safetensors with phi, theta, momentum),
and writes the new phi, momentum and the round's outcome to --out. --poison makes it a hostile
peer (NaN or 1e6-scaled fast weights); --die-after-writes makes it exit mid-exchange.

    python -m tests.helpers.outer_peer --state S --out O --ready-file R --go-file G [--initial-peers M]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from noloco_node import __version__
from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
from noloco_node.dht.records import StageRecord
from noloco_node.node import DhtMatching
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.router import Bans
from noloco_node.rpc import outer_service
from noloco_node.rpc.outer_service import OuterClient, OuterServicer
from noloco_node.rpc.server import NodeServer
from noloco_node.runtime.compute import ComputeThread
from noloco_node.sync.noloco import NoLoCoSync

RUN, MANIFEST = "outer-test", "m-outer"
log = logging.getLogger("outer_peer")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--state", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ready-file", required=True)
    p.add_argument("--go-file", required=True)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--codec", default="none")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--beta", type=float, default=0.7)
    p.add_argument("--match-s", type=float, default=5.0)
    p.add_argument("--poison", choices=["nan", "scale"])
    p.add_argument("--die-after-writes", type=int, default=0)
    return p.parse_args()


async def main(args: argparse.Namespace) -> None:
    tensors = load_file(args.state)
    model = nn.Module()
    model.w = nn.Parameter(tensors["phi"].clone())
    state = OuterState(model.named_parameters(), alpha=args.alpha, beta=args.beta)
    state.momentum["w"] = tensors["momentum"].clone()
    with torch.no_grad():
        model.w.copy_(tensors["theta"])
        if args.poison == "nan":
            model.w.fill_(float("nan"))
        elif args.poison == "scale":
            model.w.mul_(1e6)
    if args.die_after_writes:
        original = outer_service.exchange_snapshots
        count = {"writes": 0}

        async def dying(read, write, *rest):
            async def counted(message):
                count["writes"] += 1
                if count["writes"] > args.die_after_writes:
                    os._exit(9)
                await write(message)
            return await original(read, counted, *rest)

        outer_service.exchange_snapshots = dying

    directory = await PeerDirectory.start(DirectoryIdentity(RUN, MANIFEST, __version__, 1),
                                          initial_peers=args.initial_peers, startup_timeout_s=20)
    compute, bans, server = ComputeThread(), Bans(), NodeServer("127.0.0.1", 0)
    status = {"status": "serving", "round": 0, "address": ""}

    async def set_status(value: str, round_index: int) -> None:
        status.update(status=value, round=round_index)
        record = StageRecord(peer_id=directory.peer_id, address=status["address"], stage=0, inner_step=0,
                             outer_round=round_index, status=value, tokens_per_s=0.0, version=__version__,
                             manifest_hash=MANIFEST, run_id=RUN, updated_at=time.time())
        await directory.announce(record, ttl_s=30)

    client = OuterClient(run_id=RUN, manifest_hash=MANIFEST, max_bytes=1 << 20)
    sync = NoLoCoSync(state, client=client, directory=DhtMatching(directory), compute=compute, peer_id=directory.peer_id,
                      stage=0, codec=args.codec, match_s=args.match_s, max_distance_ratio=10.0, bans=bans,
                      set_status=set_status)
    server.add_outer(OuterServicer(sync, run_id=RUN, manifest_hash=MANIFEST, stage=0, max_bytes=1 << 20,
                                   timeout_s=args.match_s))
    port = await server.start()
    status["address"] = f"127.0.0.1:{port}"
    await set_status("serving", 0)
    Path(args.ready_file).write_text(json.dumps({"peer_id": directory.peer_id, "address": status["address"],
                                                 "maddrs": await directory.visible_maddrs()}))
    while not os.path.exists(args.go_file):
        await asyncio.sleep(0.02)
    log.info("round starts")
    outcome = await sync.outer_step(inner_step=50, round_index=1)
    log.info("round done: %s", outcome)
    save_file({"phi": state.phi["w"], "momentum": state.momentum["w"], "theta": model.w.detach().clone()}, args.out)
    Path(args.out + ".json").write_text(json.dumps({"outcome": outcome, "peer_id": directory.peer_id,
                                                    "counters": {k: v for k, v in vars(sync.counters).items() if k != "history"},
                                                    "history": sync.counters.history, "banned": bans.total}))
    await asyncio.sleep(1.0)  # let a partner finish reading our receipt before we close
    for step in (server.stop(1.0), client.close(), directory.shutdown()):
        try:
            await asyncio.wait_for(step, timeout=5)
        except asyncio.TimeoutError:
            log.warning("shutdown step timed out")
    compute.shutdown()


if __name__ == "__main__":
    from noloco_node.runtime.logging import setup_logging

    setup_logging("INFO")
    asyncio.run(main(parse()))
