"""`noloco-node bootstrap`: a DHT-only peer with a persistent identity; prints its multiaddr."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from noloco_node.cli.common import add_config_flags, resolve_config, stop_on_signals
from noloco_node.runtime.files import atomic_write_text


def register(subparsers) -> None:
    p = subparsers.add_parser("bootstrap", help="run a DHT-only bootstrap peer", description=__doc__)
    add_config_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for a public peer)")
    p.add_argument("--port", type=int, default=0, help="TCP port (0 = any; use a fixed one for a public peer)")
    p.add_argument("--identity", default="bootstrap.key", help="private key file; created once, keeps the peer id stable")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR", help="other bootstrap peers to link to")
    p.add_argument("--maddr-file", help="also write the multiaddrs here, one per line")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = resolve_config(args)
    return asyncio.run(_serve(config, args))


async def _serve(config, args: argparse.Namespace) -> int:
    from noloco_node import __version__
    from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
    from noloco_node.rpc.security import read_swarm_key
    from noloco_node.transport.relay import RelayService

    stop = stop_on_signals()
    Path(args.identity).parent.mkdir(parents=True, exist_ok=True)
    directory = await PeerDirectory.start(
        DirectoryIdentity(config.run.run_id, "", __version__, config.pipeline.num_stages),
        initial_peers=args.initial_peers, host=args.host, port=args.port, identity_path=args.identity,
        startup_timeout_s=config.timeouts.startup_s, swarm_key=read_swarm_key(config.security),
        max_skew_s=config.security.max_clock_skew_s)
    # Nodes behind NAT reserve a slot here and reach each other through this splice (transport/relay.py).
    relay = RelayService(directory.p2p)
    await relay.start()
    maddrs = await directory.visible_maddrs()
    if args.maddr_file:
        atomic_write_text(args.maddr_file, "\n".join(maddrs) + "\n")
    print("bootstrap peer is up; nodes join with:", flush=True)
    for maddr in maddrs:
        print(f"  noloco-node join --initial-peers {maddr}", flush=True)
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await relay.close()
        await directory.shutdown()
    return 0
