"""A peer that runs one outer round (NoLoCo or DiLoCo) over a given one-tensor state, as its own
process: the product's parts unchanged (DHT directory, gRPC Outer service, NoLoCoSync, hivemind
all-reduce, OuterState) without a model. Used by the outer-step tests and benchmarks/outer_sync.py.

The state comes from --state (safetensors with phi, theta, momentum, and optionally offset2 ...
offsetN: before round r >= 2 theta is set to phi + offset<r>) or is random with --numel; the new
phi, momentum, theta (and phi@r, momentum@r after each of --rounds rounds) and the rounds'
outcomes, times and bytes are written to --out.
Fault injection for tests: --poison (NaN or 1e6-scaled fast weights), --die-after-writes,
--fault POINT:ACTION (runtime/faults.py, e.g. exchange_write:stall=30@3: a partner that stops
sending). Deadlines follow the link (runtime/link_estimates.py): --assumed-mbit, --stall-s,
--deadline-slack, --deadline-ceiling-s; the peers' measured links go to --out's JSON ("links").
With --fetch-state the peer runs no round: it copies another peer's phi and momentum over
Outer.FetchState (deadline floor --rpc-s) and writes them to --out; --serve-until FILE keeps a
peer serving (its state, too) until FILE exists.

    python -m noloco_node.experiments.outer_peer --state S --out O --ready-file R --go-file G [--initial-peers M]
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
from noloco_node.node.adapters import DhtMatching
from noloco_node.optim.state import OuterState
from noloco_node.pipeline.router import Bans
from noloco_node.config import OuterConfig
from noloco_node.rpc.checks import ServedRun
from noloco_node.rpc.outer_service import OuterClient, OuterServicer, Traffic
from noloco_node.rpc.server import NodeServer
from noloco_node.runtime.compute import ComputeThread
from noloco_node.runtime.faults import FaultInjector
from noloco_node.runtime.link_estimates import LinkDeadlines
from noloco_node.sync.diloco import DiLoCoSync
from noloco_node.sync.noloco import NoLoCoSync
from noloco_node.sync.pairing import NoLoCoSettings
from noloco_node.sync.ports import SyncParts
from noloco_node.runtime.files import atomic_write_text

from noloco_node.rpc.stage_service import GRPC_OPTIONS
from noloco_node.transport.links import Links
from noloco_node.experiments.outer_peer_net import (
    MANIFEST,
    RUN,
    Announcer,
    close_all,
    contact_lookup,
    link_deadlines,
    node_server,
)

log = logging.getLogger("outer_peer")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--state", help="safetensors with phi, theta, momentum (1-D float tensors)")
    p.add_argument("--numel", type=int, default=0, help="instead of --state: random state of this many floats")
    p.add_argument("--method", choices=["noloco", "diloco"], default="noloco")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--ready-file", required=True)
    p.add_argument("--go-file", required=True)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--codec", default="none", help="phi (or theta) codec, e.g. bf16 or slice:0.03125")
    p.add_argument("--codec-delta", help="outer delta codec (default: --codec), e.g. topk:0.05")
    p.add_argument(
        "--payload", choices=["theta", "phi+delta"], help="force the snapshot form (default: the node picks)"
    )
    p.add_argument("--gamma", type=float, help="default: beta")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--beta", type=float, default=0.7)
    p.add_argument("--match-s", type=float, default=5.0)
    p.add_argument("--matchmaking-s", type=float, default=1.0, help="diloco: hivemind's minimum matchmaking time")
    p.add_argument("--group-size", type=int, default=64, help="diloco: hivemind's target group size")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = any)")
    p.add_argument("--announce-addr", help="host:port peers dial for our gRPC server (e.g. a WAN relay)")
    p.add_argument("--dht-port", type=int, default=0, help="diloco: the all-reduce peer's port")
    p.add_argument("--dht-announce", help="diloco: host:port peers dial for the all-reduce (e.g. a WAN relay)")
    p.add_argument("--poison", choices=["nan", "scale"])
    p.add_argument("--die-after-writes", type=int, default=0)
    p.add_argument("--fault", action="append", default=[], help="a fault spec (runtime/faults.py); repeatable")
    p.add_argument("--assumed-mbit", type=float, default=5.0, help="timeouts.assumed_mbit_s")
    p.add_argument("--stall-s", type=float, default=10.0, help="timeouts.stall_s (progress deadline)")
    p.add_argument("--deadline-slack", type=float, default=3.0, help="timeouts.deadline_slack")
    p.add_argument(
        "--deadline-ceiling-s",
        type=float,
        default=3600.0,
        help="timeouts.deadline_ceiling_s (= --match-s: the fixed deadlines before they followed the link)",
    )
    p.add_argument("--fetch-state", action="store_true", help="copy another peer's state instead of running rounds")
    p.add_argument("--rpc-s", type=float, default=30.0, help="--fetch-state: the deadline's floor (timeouts.rpc_s)")
    p.add_argument("--serve-until", help="keep serving after the rounds until this file exists")
    return p.parse_args(argv)


def outer_config(args: argparse.Namespace) -> OuterConfig:
    # --codec is phi's (and theta's); OuterConfig.codec, the default of both, takes dense codecs only.
    dense = args.codec if args.codec in ("none", "bf16", "int8") else "none"
    return OuterConfig(
        method=args.method,
        alpha=args.alpha,
        beta=args.beta,
        gamma=args.gamma,
        codec=dense,
        codec_phi=args.codec,
        codec_delta=args.codec_delta or args.codec,
        inner_steps_per_outer=50,
    )


def initial_state(args: argparse.Namespace) -> tuple[nn.Module, OuterState, dict]:
    """A one-tensor model with its outer state, from --state or random (--numel), poisoned on request."""
    if args.state:
        tensors = load_file(args.state)
    else:
        # Replicas share phi (the run's slow weights); their fast weights drifted apart.
        phi = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)) * 0.02
        drift = torch.randn(args.numel, generator=torch.Generator().manual_seed(1 + args.seed))
        tensors = {"phi": phi, "theta": phi + 1e-3 * drift, "momentum": torch.zeros(args.numel)}
    model = nn.Module()
    model.w = nn.Parameter(tensors["phi"].clone())
    state = OuterState(model.named_parameters(), alpha=args.alpha, beta=args.beta, gamma=args.gamma)
    state.momentum["w"] = tensors["momentum"].clone()
    with torch.no_grad():
        model.w.copy_(tensors["theta"])
        if args.poison == "nan":
            model.w.fill_(float("nan"))
        elif args.poison == "scale":
            model.w.mul_(1e6)
    return model, state, tensors


async def run_rounds(
    args: argparse.Namespace, sync, model: nn.Module, state: OuterState, tensors: dict
) -> tuple[str, dict]:
    """The --rounds outer rounds (theta reset to phi + offset<r> before round r >= 2)."""
    per_round, outcome = {}, "solo"
    for round_index in range(1, args.rounds + 1):
        if round_index > 1 and f"offset{round_index}" in tensors:
            with torch.no_grad():
                model.w.copy_(state.phi["w"] + tensors[f"offset{round_index}"])
        outcome = await sync.outer_step(inner_step=50 * round_index, round_index=round_index)
        log.info("round %d done: %s", round_index, outcome)
        per_round.update(
            {f"phi@{round_index}": state.phi["w"].clone(), f"momentum@{round_index}": state.momentum["w"].clone()}
        )
    return outcome, per_round


class _Donor:
    """sync.ports.StateDonor for one tensor: phi and momentum, at inner step 0."""

    def __init__(self, state: OuterState) -> None:
        self.state = state

    async def export_state(self) -> tuple[dict, str]:
        tensors = {"phi/w": self.state.phi["w"].clone(), "momentum/w": self.state.momentum["w"].clone()}
        return tensors, json.dumps({"inner_step": 0, "outer_round": self.state.round})


async def _donors(directory: PeerDirectory, wait_s: float) -> list[str]:
    """The other peers' ids, looked up again for up to `wait_s`: a record stored a moment ago may
    not have reached the peers this one asks yet (seen on a loaded machine)."""
    deadline = time.monotonic() + wait_s
    while True:
        donors = [r.peer_id for r in await directory.replicas(0, fresh=True) if r.peer_id != directory.peer_id]
        if donors:
            return donors
        if time.monotonic() >= deadline:
            raise RuntimeError(f"--fetch-state: no other peer to copy from (looked for {wait_s:.0f} s)")
        await asyncio.sleep(0.5)


async def fetch_from_peer(
    args: argparse.Namespace, directory: PeerDirectory, client: OuterClient, state: OuterState
) -> tuple[dict, dict]:
    """--fetch-state: another peer's phi and momentum, and how long the copy took."""
    donors = await _donors(directory, wait_s=args.match_s)
    expected = {f"{kind}/w": (tuple(state.phi["w"].shape), state.phi["w"].dtype) for kind in ("phi", "momentum")}
    start = time.monotonic()
    tensors, counters = await client.fetch_state(
        donors[0], stage=0, requester=directory.peer_id, timeout_s=args.rpc_s, expected=expected
    )
    seconds = time.monotonic() - start
    log.info(
        "fetched %d bytes of state from %s in %.1f s",
        sum(t.numel() * t.element_size() for t in tensors.values()),
        donors[0][-8:],
        seconds,
    )
    return {"phi": tensors["phi/w"], "momentum": tensors["momentum/w"]}, {
        "outcome": "fetched",
        "fetch_s": seconds,
        "donor": donors[0],
        "counters": counters,
    }


async def main(args: argparse.Namespace) -> None:
    model, state, tensors = initial_state(args)
    faults = _fault_injector(args)
    deadlines = link_deadlines(args)
    directory = await PeerDirectory.start(
        DirectoryIdentity(RUN, MANIFEST, __version__, 1), initial_peers=args.initial_peers, startup_timeout_s=20
    )
    all_reduce = await _all_reduce(args, directory, model) if args.method == "diloco" else None
    links = Links(
        directory.key, swarm_key=None, max_skew_s=60.0, options=GRPC_OPTIONS, lookup=contact_lookup(directory)
    )
    compute, bans = ComputeThread(), Bans()
    config = outer_config(args)
    server = node_server(args, links)
    announcer = Announcer(directory, links, deadlines)
    max_bytes = 16 * max(1, model.w.numel()) + (1 << 20)  # phi and delta, float64
    traffic = Traffic()
    client = OuterClient(
        run_id=RUN,
        manifest_hash=MANIFEST,
        max_bytes=max_bytes,
        traffic=traffic,
        dialer=links.dialer,
        faults=faults,
        deadlines=deadlines,
    )
    parts = SyncParts(
        compute=compute, peer_id=directory.peer_id, stage=0, set_status=announcer.set_status, faults=faults
    )
    if all_reduce is not None:
        sync = DiLoCoSync(state, config, parts, all_reduce=all_reduce, timeout_s=args.match_s + 10)
    else:
        sync = NoLoCoSync(
            state,
            config,
            parts,
            transport=client,
            directory=DhtMatching(directory),
            settings=NoLoCoSettings(match_s=args.match_s, payload=args.payload),
            bans=bans,
        )
        server.add_outer(_pairing_servicer(sync, directory.peer_id, state, client))
    await _announce_ready(args, server, announcer, directory)
    await _wait_for(args.go_file, poll_s=0.02)
    log.info("round starts")
    if args.fetch_state:
        outputs, summary = await fetch_from_peer(args, directory, client, state)
    else:
        outputs, summary = await _rounds_with_summary(args, sync, model, state, tensors, bans)
    _write_outputs(args, directory.peer_id, outputs, summary, deadlines)
    await asyncio.sleep(1.0)  # let a partner finish reading our receipt before we close
    if args.serve_until:
        await _wait_for(args.serve_until, poll_s=0.05)
    await close_all(server, client, links, directory)
    if all_reduce is not None:
        all_reduce.shutdown()
    compute.shutdown()


def _pairing_servicer(sync: NoLoCoSync, peer_id: str, state: OuterState, client: OuterClient) -> OuterServicer:
    """The Outer service that answers our partners, and serves our state, with the client's byte
    limit, deadlines, fault injector and traffic count: one count for both sides of exchanges."""
    return OuterServicer(
        sync,
        peer_id=peer_id,
        run=ServedRun(RUN, MANIFEST, 0),
        max_bytes=client.max_bytes,
        deadlines=client.deadlines,
        traffic=client.traffic,
        faults=client.faults,
        donor=_Donor(state),
    )


async def _announce_ready(
    args: argparse.Namespace, server: NodeServer, announcer: Announcer, directory: PeerDirectory
) -> None:
    """Serve, announce the address peers dial, and tell the harness (--ready-file) where we are."""
    port = await server.start()
    address = args.announce_addr or f"127.0.0.1:{port}"
    await announcer.serve_at(address)
    atomic_write_text(
        args.ready_file,
        json.dumps({"peer_id": directory.peer_id, "address": address, "maddrs": await directory.visible_maddrs()}),
    )


async def _rounds_with_summary(
    args: argparse.Namespace, sync, model: nn.Module, state: OuterState, tensors: dict, bans: Bans
) -> tuple[dict, dict]:
    """The --rounds outer rounds; the state they left (for --out) and their summary (its JSON)."""
    outcome, per_round = await run_rounds(args, sync, model, state, tensors)
    outputs = {"phi": state.phi["w"], "momentum": state.momentum["w"], "theta": model.w.detach().clone(), **per_round}
    summary = {
        "outcome": outcome,
        "bytes_sent": sync.bytes_sent,
        "method": args.method,
        "counters": {k: v for k, v in vars(sync.counters).items() if k != "history"},
        "history": sync.counters.history,
        "banned": bans.total,
    }
    return outputs, summary


def _fault_injector(args: argparse.Namespace) -> FaultInjector:
    """The faults of --fault, and --die-after-writes N's: the process exits at its (N+1)th write of
    an exchange, mid-stream."""
    return FaultInjector(
        ([f"exchange_write:crash@{args.die_after_writes + 1}"] if args.die_after_writes else []) + list(args.fault)
    )


async def _wait_for(path: str, *, poll_s: float) -> None:
    """Until the file `path` exists (the test harness's signal)."""
    while not os.path.exists(path):
        await asyncio.sleep(poll_s)


def _write_outputs(
    args: argparse.Namespace, peer_id: str, outputs: dict, summary: dict, deadlines: LinkDeadlines
) -> None:
    """The tensors to --out, and the summary with the measured links to --out's JSON."""
    save_file(outputs, args.out)
    Path(args.out + ".json").write_text(
        json.dumps({"peer_id": peer_id, **summary, "links": deadlines.estimates.summary()})
    )


async def _all_reduce(args: argparse.Namespace, directory: PeerDirectory, model: nn.Module):
    """DiLoCo's averager; it forks hivemind processes, so before any gRPC thread exists."""
    from noloco_node.dht.averaging import GroupSettings, HivemindAllReduce

    # The first peer has no initial peers: its averager joins through its own DHT node.
    peers = args.initial_peers or await directory.visible_maddrs()
    # The DHT in a thread (it pings ours, which needs this loop running); the averager on
    # the main thread (hivemind installs signal handlers there).
    dht = await asyncio.to_thread(HivemindAllReduce.start_dht, peers, "127.0.0.1", args.dht_port, args.dht_announce)
    return HivemindAllReduce(
        [model.w.shape],
        GroupSettings(prefix="outer_test_diloco", target_group_size=args.group_size, matchmaking_s=args.matchmaking_s),
        dht=dht,
    )


if __name__ == "__main__":
    from noloco_node.runtime.logging import setup_logging

    setup_logging("INFO")
    asyncio.run(main(parse()))
