"""`noloco-node doctor`: preflight checks before `join`, each with what is wrong and the fix.

Checks, in order, with the exit code a failure returns (the first failure's code wins):
  10 python   Python >= 3.11 and torch import
  11 cuda     a GPU torch can use (only a failure with --require-gpu; otherwise informational)
  12 port     the gRPC port (network.port) can be bound on network.host
  13 dht      the bootstrap peers answer within timeouts.startup_s
  14 reach    how peers will reach us: live peers dial our announced TLS address (they call our health
              endpoint); if none can, the node is reached over libp2p (hole punching, else a relay),
              which is no failure unless network.reach = "direct"; a failure when the peers asked
              serve another run (run.run_id: the swarm's config is not this one)
  15 clock    our clock is within --max-skew seconds of the peers' clocks
  16 compat   live peers run a compatible version and the same manifest (config + tokenizer)
  17 disk     the checkpoint folder (checkpoint.dir, or join's own under the state home) can be
              written; it says its free space
reach and clock ask the live directly reachable nodes, then the initial peers (a bootstrap answers
probes, so the first volunteer of a swarm is checked too); compat is skipped (not failed) while
the swarm has no live node yet.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from dataclasses import dataclass

from noloco_node.cli.common import add_config_flags, require_initial_peers, resolve_config
from noloco_node.runtime.node_status import Status

CODES = {"python": 10, "cuda": 11, "port": 12, "dht": 13, "reach": 14, "clock": 15, "compat": 16, "disk": 17}


@dataclass
class Check:
    name: str
    outcome: str  # ok | fail | skip | info
    detail: str
    fix: str = ""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="preflight checks before joining a swarm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p)
    p.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        help="the swarm's bootstrap multiaddrs (default: network.initial_peers of --config)",
    )
    p.add_argument("--host", help="address the node will bind (network.host)")
    p.add_argument("--port", type=int, help="gRPC port the node will use (network.port)")
    p.add_argument("--announce-addr", metavar="HOST:PORT", help="address peers will dial (network.announce_addr)")
    p.add_argument("--require-gpu", action="store_true", help="fail (exit 11) when torch sees no CUDA device")
    p.add_argument("--max-skew", type=float, default=2.0, metavar="SECONDS", help="largest clock offset to accept")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = resolve_config(
        args,
        flags={
            "network": {
                "initial_peers": args.initial_peers,
                "host": args.host,
                "port": args.port,
                "announce_addr": args.announce_addr,
            }
        },
    )
    require_initial_peers(config)
    checks = asyncio.run(_run_checks(config, args))
    failed = None
    for check in checks:
        mark = {"ok": "ok  ", "fail": "FAIL", "skip": "skip", "info": "info"}[check.outcome]
        print(f"[{mark}] {check.name:<7} {check.detail}")
        if check.outcome == "fail":
            print(f"         fix: {check.fix}")
            failed = failed or check.name
    print("all checks passed" if failed is None else f"doctor: check '{failed}' failed (exit {CODES[failed]})")
    sys.stdout.flush()
    return 0 if failed is None else CODES[failed]


def _python_checks(require_gpu: bool) -> list[Check]:
    if sys.version_info < (3, 11):
        return [
            Check("python", "fail", f"Python {sys.version.split()[0]}", "use Python 3.11 or newer (scripts/setup.sh)")
        ]
    try:
        import torch
    except ImportError as exc:
        return [Check("python", "fail", f"torch does not import: {exc}", "run scripts/setup.sh (or pip install -e .)")]
    checks = [Check("python", "ok", f"Python {sys.version.split()[0]}, torch {torch.__version__}")]
    if torch.cuda.is_available():
        checks.append(Check("cuda", "ok", f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}"))
    elif require_gpu:
        checks.append(
            Check(
                "cuda",
                "fail",
                "torch sees no CUDA device",
                "install a CUDA build of torch and the NVIDIA driver, or run the Docker image in deploy/",
            )
        )
    else:
        checks.append(Check("cuda", "info", "no CUDA device; the node will train on CPU"))
    return checks


def _port_check(host: str, port: int) -> Check:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        return Check(
            "port",
            "fail",
            f"cannot bind {host}:{port}: {exc.strerror}",
            "stop what uses the port or pick another with --port (network.port)",
        )
    bound = sock.getsockname()[1]
    sock.close()
    return Check("port", "ok", f"{host}:{bound} is free")


def _disk_check(config) -> Check:
    """Where `join` will write its checkpoints, that it can, and the free space there."""
    import shutil
    import tempfile
    from pathlib import Path

    from noloco_node.node.checkpoint_home import config_fingerprint, run_directory

    if config.checkpoint.dir is None and not config.checkpoint.auto:
        return Check("disk", "info", "no checkpoints (checkpoint.auto = false and no checkpoint.dir)")
    folder = (
        Path(config.checkpoint.dir).expanduser()
        if config.checkpoint.dir
        else run_directory(config.run.run_id, config_fingerprint(config))
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-"):
            pass
        free = shutil.disk_usage(folder).free
    except OSError as e:
        return Check(
            "disk",
            "fail",
            f"cannot write checkpoints in {folder}: {e.strerror or e}",
            "set checkpoint.dir to a writable folder (or checkpoint.auto = false for no checkpoints)",
        )
    return Check("disk", "ok", f"checkpoints go to {folder} ({free / 1e9:.1f} GB free)")


async def _run_checks(config, args) -> list[Check]:
    checks = _python_checks(args.require_gpu)
    net = config.network
    port_check = _port_check(net.host, net.port)
    checks.append(port_check)
    checks.append(_disk_check(config))

    from noloco_node import __version__
    from noloco_node.dht.directory import DirectoryIdentity, PeerDirectory, compatible_version
    from noloco_node.node.joining import peer_ids_of
    from noloco_node.rpc.security import read_swarm_key
    from noloco_node.errors import BootstrapError

    try:
        directory = await PeerDirectory.start(
            DirectoryIdentity(config.run.run_id, "", __version__, config.pipeline.num_stages),
            initial_peers=list(net.initial_peers),
            host=net.host,
            startup_timeout_s=config.timeouts.startup_s,
            client_mode=True,
            swarm_key=read_swarm_key(config.security),
            max_skew_s=config.security.max_clock_skew_s,
        )
    except BootstrapError as exc:
        checks.append(Check("dht", "fail", str(exc), BootstrapError.hint))
        return checks + [Check(n, "skip", "needs the DHT") for n in ("reach", "clock", "compat")]
    try:
        records = [
            r
            for s in range(config.pipeline.num_stages)
            for r in await directory.all_records(s)
            if r.status != Status.LEAVING
        ]
        checks.append(
            Check(
                "dht",
                "ok",
                f"joined through {len(net.initial_peers)} initial peer(s); "
                f"{len(records)} live node(s) in run {config.run.run_id!r}",
            )
        )
        # As join asks: live directly reachable nodes first, then the initial peers (a bootstrap
        # answers probes too, so the first volunteer of a swarm is checked as well).
        probers = [r.peer_id for r in records if r.reach == "direct"]
        probers += [p for p in peer_ids_of(net.initial_peers) if p not in probers]
        checks += await _reach_and_clock(config, args, directory, records, probers, port_check.outcome == "ok")
    finally:
        await directory.shutdown()
    if not records:
        return checks + [Check("compat", "skip", "no live node to compare with yet")]
    checks.append(_compat_check(config, records, __version__, compatible_version))
    return checks


async def _reach_and_clock(config, args, directory, records, probers: list[str], port_free: bool) -> list[Check]:
    if not port_free:
        return [Check("reach", "skip", "the port is not free"), Check("clock", "skip", "needs a probe")]
    if not probers:
        return [Check("reach", "skip", "no directly reachable node to ask"), Check("clock", "skip", "needs a probe")]
    from noloco_node.rpc.diagnostics import other_run

    address, results, errors = await _probe_from_peers(config, directory, records, probers)
    if not results and (other := other_run(errors)) is not None:
        return [_run_check(config.run.run_id, other), Check("clock", "skip", "needs a probe")]
    if not results:
        return [
            Check("reach", "skip", f"no live node answered a probe request ({'; '.join(errors)[:200]})"),
            Check("clock", "skip", "needs a probe"),
        ]
    return [_reach_check(config.network, address, results), _clock_check(args.max_skew, results)]


def _run_check(mine: str, theirs: str) -> Check:
    """A peer serves another run: join would wait alone in a run of its own (the DHT keeps runs
    apart), and the swarm's page would never show it (a newcomer copied a join line without the
    swarm's config: every check passed, and the node waited for ever)."""
    return Check(
        "reach",
        "fail",
        f"the swarm's peers serve run {theirs!r}; this config's run is {mine!r}: join would train alone",
        f"use the swarm's config: --config FILE as the bootstrap's join line says (or --set run.run_id={theirs} "
        "with the rest of its settings)",
    )


async def _probe_from_peers(config, directory, records, probers: list[str]) -> tuple[str, list, list[str]]:
    """Serve a throwaway TLS health endpoint, as join will, and ask up to 4 peers to dial it (over
    libp2p where they are not directly reachable, as a bootstrap is): the announced address, the
    peers' answers, and why the others gave none."""
    from noloco_node.node.joining import announced_address, contact_lookup
    from noloco_node.rpc.diagnostics import probe_from_peers
    from noloco_node.rpc.security import read_swarm_key
    from noloco_node.rpc.server import NodeServer
    from noloco_node.transport.dialer import Contact
    from noloco_node.transport.links import Links
    from noloco_node.transport.tls import NodeCertificate

    net = config.network
    certificate = NodeCertificate.generate()
    server = NodeServer(net.host, net.port, credentials=certificate.server_credentials())
    port = await server.start()
    address = announced_address(net.host, port, net.announce_addr, [])
    # The records read above (this check has no manifest, so the directory's own lookup, which
    # ignores other manifests, would find none of them), else an initial peer over libp2p.
    known = {r.peer_id: Contact(r.peer_id, r.address, r.reach, r.tls_cert, tuple(r.p2p_addrs)) for r in records}
    initial = contact_lookup(directory)

    async def lookup(peer_id: str):
        return known.get(peer_id) or await initial(peer_id)

    links = Links(
        directory.key,  # libp2p proves this key: calls over the bridge must be signed with it
        swarm_key=read_swarm_key(config.security),
        max_skew_s=config.security.max_clock_skew_s,
        lookup=lookup,
    )
    try:
        await links.dial_over(directory.p2p)
        results, errors = await probe_from_peers(
            address,
            probers[:4],
            run_id=config.run.run_id,
            timeout_s=config.timeouts.connect_s,
            dialer=links.dialer,
            tls_cert=certificate.cert_der,
        )
    finally:
        await links.close()
        await server.stop(0.5)
    return address, results, errors


def _reach_check(net, address: str, results: list) -> Check:
    reached = [r for r in results if r.reachable]
    forward = (
        "for direct (faster) links, forward a fixed gRPC port (--port) to this machine and announce the "
        "public host:port with --announce-addr; check the firewall"
    )
    if reached:
        return Check(
            "reach",
            "ok",
            f"{len(reached)}/{len(results)} peer(s) reached {address}: peers will dial us directly over TLS",
        )
    if net.reach == "direct":
        return Check(
            "reach",
            "fail",
            f"no peer could reach {address}: {results[0].detail} (network.reach = direct)",
            forward + ', or set network.reach = "auto" to be reached over libp2p instead',
        )
    return Check(
        "reach",
        "info",
        f"no peer could reach {address} ({results[0].detail}): this node is behind "
        "NAT or a firewall and will be reached over libp2p, hole-punched where the routers allow, "
        "else through a relay (a public peer; slower). Nothing to configure",
        forward,
    )


def _clock_check(max_skew: float, results: list) -> Check:
    skew = max((r.skew_s for r in results), key=abs)
    if abs(skew) <= max_skew:
        return Check("clock", "ok", f"clock offset to peers {skew:+.3f} s")
    return Check(
        "clock",
        "fail",
        f"clock offset to a peer is {skew:+.1f} s (limit {max_skew} s)",
        "enable time sync (NTP: `timedatectl set-ntp true`); DHT records expire by wall clock",
    )


def _compat_check(config, records, version: str, compatible_version) -> Check:
    from noloco_node.node.manifest import load_run_inputs

    _, _, manifest = load_run_inputs(config)
    bad_version = sorted({r.version for r in records if not compatible_version(version, r.version)})
    bad_manifest = sorted({r.manifest_hash for r in records if r.manifest_hash != manifest})
    if bad_version:
        return Check(
            "compat",
            "fail",
            f"peers run version(s) {', '.join(bad_version)}, we run {version}",
            "install the swarm's noloco-node version (same major.minor)",
        )
    if bad_manifest:
        return Check(
            "compat",
            "fail",
            f"peers use manifest {', '.join(bad_manifest)}, ours is {manifest}",
            "use the swarm's config file (--config) and data/tokenizer; `noloco-node config show` prints yours",
        )
    return Check("compat", "ok", f"version {version} and manifest {manifest} match {len(records)} node(s)")
