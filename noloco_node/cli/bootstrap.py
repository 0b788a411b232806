"""`noloco-node bootstrap`: a DHT peer with a persistent identity; prints its multiaddr. Public by
definition, it also relays between peers behind NAT and answers Diagnostics.Probe (over libp2p, on
the one port every peer already dials), so a joining node can prove its address is reachable even
when no other node is."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
from pathlib import Path

from noloco_node.cli.common import add_config_flags, check_listen, resolve_config, stop_on_signals
from noloco_node.config.listen import parse_listen
from noloco_node.runtime.every import TOUCH_PERIOD_S
from noloco_node.runtime.files import atomic_write_text

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("bootstrap", help="run a DHT-only bootstrap peer", description=__doc__)
    add_config_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for a public peer)")
    p.add_argument(
        "--port",
        type=int,
        default=31330,
        help="TCP port (default 31330: with the identity file, the "
        "multiaddr stays the same across restarts; 0 = any free port, a new one each start)",
    )
    p.add_argument(
        "--identity", default="bootstrap.key", help="private key file; created once, keeps the peer id stable"
    )
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR", help="other bootstrap peers to link to")
    p.add_argument(
        "--maddr-file",
        action="append",
        default=[],
        help="also write the multiaddrs here, one per line (removed at exit; repeatable)",
    )
    p.add_argument(
        "--dashboard",
        metavar="[HOST:]PORT",
        help="serve the swarm's live web page and its JSON "
        "(/api/swarm, /api/history) here; a bare PORT binds 127.0.0.1, 0.0.0.0:PORT shows it to everyone "
        "(network.dashboard; docs/dashboard.md)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    peers = tuple(args.initial_peers) or None  # checked as the config checks a node's
    config = resolve_config(args, flags={"network": {"dashboard": args.dashboard, "initial_peers": peers}})
    check_listen(args.host, {"--port": args.port}, "--host")
    if config.network.dashboard is not None:
        host, port = parse_listen(config.network.dashboard)
        check_listen(host, {"--dashboard": port}, "--dashboard")
    if config.network.metrics_port is not None:
        check_listen(config.network.host, {"network.metrics_port": config.network.metrics_port}, "network.host")
    return asyncio.run(_serve(config, args))


async def _serve(config, args: argparse.Namespace) -> int:
    from noloco_node import __version__
    from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory
    from noloco_node.rpc.security import read_swarm_key

    key = _identity(args.identity)
    for path in args.maddr_file:  # one left by a run that was killed would say "up" before we are (compose waits on it)
        Path(path).unlink(missing_ok=True)
    stop = stop_on_signals()
    swarm_key = read_swarm_key(config.security)
    directory = await PeerDirectory.start(
        DirectoryIdentity(config.run.run_id, "", __version__, config.pipeline.num_stages),
        initial_peers=list(config.network.initial_peers),
        host=args.host,
        port=args.port,
        key=key,
        startup_timeout_s=config.timeouts.startup_s,
        swarm_key=swarm_key,
        max_skew_s=config.security.max_clock_skew_s,
        alone_if_unanswered=True,  # the other bootstraps may be down too (a cold start of them all)
    )
    links, server = await _serve_probes(config, directory, swarm_key)
    maddrs = await directory.visible_maddrs()
    for path in args.maddr_file:
        atomic_write_text(path, "\n".join(maddrs) + "\n")
    print("bootstrap peer is up; nodes join with:", flush=True)
    program = typed_program(sys.argv[0])
    for line in join_lines(maddrs, config.security.swarm_key_file, args.config, args.overrides, program):
        print(line, flush=True)
    if args.config or args.overrides:
        print(f"  (every node of run {config.run.run_id!r} needs this config: give them {_settings(args)})", flush=True)
    sys.stdout.flush()
    dashboard = metrics = touch = None
    try:
        dashboard = (
            await _serve_dashboard(config, directory, args.identity) if config.network.dashboard is not None else None
        )
        metrics = _serve_metrics(config, links, directory.peer_id) if config.network.metrics_port is not None else None
        touch = asyncio.create_task(_keep_in_touch(directory, max(config.timeouts.heartbeat_s, TOUCH_PERIOD_S)))
        await stop.wait()
    finally:
        if touch is not None:
            touch.cancel()
        if dashboard is not None:
            await dashboard.close()
        if metrics is not None:
            metrics.stop()
        for path in args.maddr_file:
            Path(path).unlink(missing_ok=True)
        await links.close()
        await server.stop(1.0)
        await directory.shutdown()
        print("bootstrap peer stopped", flush=True)
    return 0


def join_lines(
    maddrs: list[str],
    swarm_key_file: str | None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
    program: str = "noloco-node",
) -> list[str]:
    """The join command for each multiaddr, with the swarm key when the swarm has one (without it
    a joiner's pings go unanswered: a newcomer copied the line and got hivemind's bootstrap error),
    the config this bootstrap was given (without it a newcomer joined run 'local' and waited
    alone for ever, every doctor check passed), and `--stage auto` (without it every volunteer who
    copied the line took stage 0, the config's default, and a fresh swarm's later stages stayed
    empty: nothing trained)."""
    key = f" --swarm-key {shlex.quote(swarm_key_file)}" if swarm_key_file else ""
    config = f" --config {shlex.quote(config_file)}" if config_file else ""
    config += "".join(f" --set {shlex.quote(item)}" for item in overrides or [] if _run_setting(item))
    # Lines for other machines first, a loopback one last and, beside them, marked (a shell comment):
    # a volunteer who copied the first printed line, 127.0.0.1, waited a minute for an error.
    from noloco_node.transport.addresses import maddr_is_loopback

    ordered = sorted(maddrs, key=maddr_is_loopback)
    mixed = not all(maddr_is_loopback(m) for m in maddrs)
    return [
        f"  {program} join{config} --initial-peers {maddr}{key} --stage auto"
        + ("   # on this machine only" if mixed and maddr_is_loopback(maddr) else "")
        for maddr in ordered
    ]


MACHINE_SETTINGS = ("network.", "checkpoint.", "log.", "security.identity_file", "pipeline.stage", "pipeline.device")
"""`--set` fields of this machine, not of the run: a joiner given the bootstrap's metrics port
collided with it on the same host (a hostile-peer audit)."""


def _run_setting(item: str) -> bool:
    return not item.split("=", 1)[0].strip().startswith(MACHINE_SETTINGS)


def typed_program(argv0: str) -> str:
    """How the user ran noloco-node, for a line they copy: `.venv/bin/noloco-node` after
    scripts/setup.sh (there is no `noloco-node` on PATH then), else the bare name (an absolute
    path is this machine's, and `python -m noloco_node` has none)."""
    typed = Path(argv0)
    return argv0 if typed.name == "noloco-node" and not typed.is_absolute() else "noloco-node"


def _settings(args: argparse.Namespace) -> str:
    parts = ([f"the file {args.config}"] if args.config else []) + (["the same --set flags"] if args.overrides else [])
    return " and ".join(parts)


def _identity(path: str):
    """The bootstrap's key, and a line that says whether it was loaded or made: a new one is a new
    peer id, so every multiaddr joiners were given stops working (a mistyped --identity path)."""
    from noloco_node.transport.identity import NodeIdentity

    existed = Path(path).expanduser().exists()
    key = NodeIdentity.load_or_create(path)
    if existed:
        print(f"identity {path}: peer id {key.peer_id}", flush=True)
    else:
        print(
            f"identity {path}: created, peer id {key.peer_id} (a new multiaddr; keep this file to keep it)", flush=True
        )
    return key


async def _keep_in_touch(directory, period_s: float) -> None:
    """Other bootstrap peers (--initial-peers) are pinged every period, so two bootstraps that
    restart at different times find each other again (nodes ping us the same way)."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await directory.keep_in_touch()
        except Exception as exc:  # noqa: BLE001 - tried again next period
            log.debug("keeping in touch with the other bootstraps failed: %r", exc)


async def _serve_probes(config, directory, swarm_key: bytes | None):
    """Diagnostics (Probe) and health behind the same admission as a node's, reachable only over
    libp2p (the gRPC ports bind 127.0.0.1); the same daemon serves the relay splice for peers
    behind NAT (transport/relay.py). Returns (links, server) for shutdown."""
    from noloco_node import __version__
    from noloco_node.rpc.diagnostics import DiagnosticsServicer
    from noloco_node.rpc.security import build_admission
    from noloco_node.rpc.server import NodeServer
    from noloco_node.rpc.stage_service import GRPC_OPTIONS
    from noloco_node.transport.links import Links

    links = Links(directory.key, swarm_key=swarm_key, max_skew_s=config.security.max_clock_skew_s, options=GRPC_OPTIONS)
    admission = build_admission(config.security, links)
    server = NodeServer(
        "127.0.0.1",
        0,
        admission=admission.interceptor,
        credentials=links.certificate.server_credentials(),
        max_concurrent_rpcs=config.security.max_concurrent_rpcs,
    )
    server.add_diagnostics(
        DiagnosticsServicer(
            run_id=config.run.run_id, version=__version__, manifest_hash="", timeout_s=config.timeouts.connect_s
        )
    )
    await server.start()
    await links.attach(directory.p2p, server.bridge_port)
    await links.serve_relay()
    return links, server


def _serve_metrics(config, links, peer_id: str):
    """/metrics with the relay's counters (network.metrics_port, on network.host)."""
    from noloco_node.node.metrics import BootstrapMetrics

    metrics = BootstrapMetrics(lambda: links.relay.stats() if links.relay is not None else None, peer_id=peer_id)
    port = metrics.serve(config.network.host, config.network.metrics_port)  # checked free in run()
    print(f"metrics at http://{config.network.host}:{port}/metrics", flush=True)
    return metrics


class _SwarmDashboard:
    def __init__(self, server, view, sampling: asyncio.Task) -> None:
        self.server, self.view, self.sampling = server, view, sampling

    async def close(self) -> None:
        self.sampling.cancel()
        await self.view.save()
        await self.server.stop()


def history_file(identity: str) -> Path:
    """Where the swarm page keeps its charts across restarts: beside the bootstrap's identity, the
    one file an operator already keeps (bootstrap.key -> bootstrap.history.json)."""
    key = Path(identity).expanduser()
    return key.with_name(f"{key.stem}.history.json")


async def _serve_dashboard(config, directory, identity: str) -> _SwarmDashboard:
    """The swarm page (docs/dashboard.md), sampled in the background: its history covers the time
    nobody watched, and a restart (saved every minute and at exit). Prints the address to open."""
    from noloco_node.dashboard.http import DashboardServer, page_url
    from noloco_node.dashboard.swarm import SwarmView

    host, port = parse_listen(config.network.dashboard)
    view = SwarmView(
        directory.all_records, config, poll_s=config.network.dashboard_poll_s, history_file=history_file(identity)
    )
    server = DashboardServer(
        pages={"/": "swarm.html", "/swarm": "swarm.html"},
        api={"/api/swarm": view.swarm, "/api/history": view.history_json},
    )
    bound = await server.start(host, port)
    elsewhere = ""
    if host in ("0.0.0.0", "::"):  # the page is meant to be shared: say where others open it
        from noloco_node.transport.addresses import maddr_host, maddr_is_loopback

        hosts = sorted(
            maddr_host(m)
            for m in await directory.visible_maddrs()
            if m.startswith("/ip4/") and not maddr_is_loopback(m)
        )
        if hosts:
            elsewhere = f" (from other machines: {page_url(hosts[0], bound)})"
    print(f"dashboard at {page_url(host, bound)}{elsewhere}", flush=True)
    return _SwarmDashboard(server, view, asyncio.create_task(view.run()))
