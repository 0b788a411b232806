"""`noloco-node status`: the swarm as stages x replicas, read from the DHT (a client-mode peer)."""

from __future__ import annotations

import argparse
import asyncio
import json

from noloco_node.cli.common import add_config_flags, require_initial_peers, resolve_config
from noloco_node.cli.other_run import run_of_initial_peers

STATUS_SECOND_READ_S = 0.5


def register(subparsers) -> None:
    p = subparsers.add_parser("status", help="show the swarm's stages and replicas", description=__doc__)
    add_config_flags(p)
    p.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        help="any peer of the swarm (default: network.initial_peers of --config)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = resolve_config(args, flags={"network": {"initial_peers": args.initial_peers}})
    require_initial_peers(config)
    from noloco_node.dashboard.swarm import swarm_json

    rows, other = asyncio.run(_collect(config))
    swarm = swarm_json(rows, config)
    if other is not None:
        swarm["attention"] = [  # rather than "stage S has no replica: join it", for each stage
            f"the swarm's peers serve run {other!r}; this config's run is {config.run.run_id!r}, which has no "
            f"node: use the swarm's config (--config FILE, as the bootstrap's join line says)"
        ]
    if args.json:
        print(json.dumps(swarm, indent=2))
        return 0
    rows, limit = swarm["replicas"], swarm["limiting_stage"]
    print(f"run {config.run.run_id}: {_count(len(rows), 'replica')} over {_count(config.pipeline.num_stages, 'stage')}")
    header = (
        f"{'stage':>5}  {'peer':<10} {'address':<22} {'reach':<12} {'inner':>6} {'round':>5} {'status':<9} "
        f"{'tok/s':>8} {'cap seq/s':>9} {'busy':>5} {'hop ms':>6} {'link Mb/s':>9} {'round MB':>8} "
        f"{'mem GiB est/peak':>16} "
        f"{'version':<8} {'seen':>6}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['stage']:>5}  {r['peer_id'][-8:]:<10} {_shown_address(r):<22} {r['reach']:<12} {r['inner_step']:>6} "
            f"{r['outer_round']:>5} "
            f"{r['status']:<9} {r['tokens_per_s']:>8.0f} {r['capacity']:>9.1f} {r['busy']:>5.2f} "
            f"{r['hop_s'] * 1e3:>6.0f} "
            f"{_mbit(r.get('link_mbit_s', 0.0)):>9} {_megabytes(r.get('outer_round_bytes', 0)):>8} {_memory(r):>16} "
            f"{r['version']:<8} {r['seen_s_ago']:>5.0f}s"
        )
    for s, total in swarm["stage_capacity"].items():
        count = sum(1 for r in rows if r["stage"] == int(s))
        mark = "  <- limits the swarm" if int(s) == limit else ""
        print(f"stage {s}: {_count(count, 'replica')}, capacity {total:.1f} sequences/s{mark}")
    for note in swarm["attention"]:
        print(f"! {note}")
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _megabytes(value: int) -> str:
    """An outer round's bytes in MB; '-' before the node's first round."""
    return f"{value / 1e6:.3g}" if value else "-"


def _memory(row: dict) -> str:
    """'estimate/peak' in GiB; '-' for what the node has not published (yet)."""

    def gib(value: int) -> str:
        return f"{value / (1 << 30):.2f}" if value else "-"

    return f"{gib(row.get('memory_estimate_bytes', 0))}/{gib(row.get('memory_peak_bytes', 0))}"


async def _collect(config) -> tuple[list[dict], str | None]:
    """The rows of this config's run, and, when it has none, the run the initial peers serve if
    it is another one (cli/other_run.py)."""
    from noloco_node import __version__
    from noloco_node.dashboard.swarm import read_rows
    from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
    from noloco_node.rpc.security import read_swarm_key

    directory = await PeerDirectory.start(
        DirectoryIdentity(config.run.run_id, "", __version__, config.pipeline.num_stages),
        initial_peers=list(config.network.initial_peers),
        host=config.network.host,
        startup_timeout_s=config.timeouts.startup_s,
        client_mode=True,
        swarm_key=read_swarm_key(config.security),
        max_skew_s=config.security.max_clock_skew_s,
    )
    try:
        # One lookup can miss a record under load (an RPC to a DHT peer holding it timed out); a
        # second, a moment later, answers with what both found (PeerDirectory._entries): a replica
        # that just joined no longer goes missing from one `status` (seen in the NAT test).
        await read_rows(directory.all_records, config.pipeline.num_stages)
        await asyncio.sleep(STATUS_SECOND_READ_S)
        rows = await read_rows(directory.all_records, config.pipeline.num_stages)
        return rows, None if rows else await run_of_initial_peers(config, directory)
    finally:
        await directory.shutdown()


def _mbit(value: float) -> str:
    """A node's measured link (its median to its peers) for the table; "-" before any measurement."""
    return "-" if value <= 0 else f"{value:.3g}"


def _shown_address(row: dict) -> str:
    """A relayed or hole-punched node is dialled by peer id over libp2p: its own bind address
    (127.0.0.1 behind NAT) read like a misconfiguration in a swarm-wide table (a NAT audit)."""
    return row["address"] if row["reach"] == "direct" else "(over libp2p)"
