"""The steps of joining a running swarm, before a node announces itself: find out how peers can
reach us (ask live peers to dial our announced TLS address; when none can, we are behind NAT and
are reached over libp2p instead), and copy a live replica's training state."""

from __future__ import annotations

import logging
import random

from noloco_node.dht.directory import PeerDirectory
from noloco_node.errors import NodeError, UnreachableAddress
from noloco_node.optim.inner import InnerOptimizer
from noloco_node.optim.state import OuterState
from noloco_node.rpc.outer_service import OuterClient
from noloco_node.runtime.compute import ComputeThread
from noloco_node.sync.transfer import expected_tensors, import_state

log = logging.getLogger(__name__)


def announced_address(host: str, port: int, announce_addr: str | None, visible_maddrs: list[str]) -> str:
    """host:port peers should dial: the configured one; else, binding every interface, our IP as
    the DHT peers see it (the first non-loopback /ip4 address libp2p observed), else host:port."""
    if announce_addr:
        return announce_addr
    if host in ("0.0.0.0", "::", ""):
        for maddr in visible_maddrs:
            parts = maddr.split("/")
            if len(parts) > 2 and parts[1] == "ip4" and not parts[2].startswith("127."):
                return f"{parts[2]}:{port}"
        return f"127.0.0.1:{port}"
    return f"{host}:{port}"


async def probe_reachable(directory: PeerDirectory, dialer, *, address: str, tls_cert: bytes, peer_id: str,
                          num_stages: int, run_id: str, timeout_s: float) -> bool | None:
    """Ask up to four live peers to dial `address` (our TLS health endpoint). True if one could,
    False if peers answered and none could, None when nobody could be asked (a first node)."""
    from noloco_node.rpc.diagnostics import probe_from_peers

    peers = [r.peer_id for s in range(num_stages) for r in await directory.replicas(s, fresh=True)
             if r.peer_id != peer_id and r.reach == "direct"]
    random.Random(peer_id).shuffle(peers)
    for attempt in range(2):
        # Once more with twice the deadline when no prober answered at all (a loaded machine):
        # an unanswered probe would otherwise read as "nobody to ask" and pass an unreachable address.
        results, errors = await probe_from_peers(address, peers[:4], run_id=run_id, timeout_s=timeout_s * (1 + attempt),
                                                 dialer=dialer, tls_cert=tls_cert)
        if results or not errors:
            break
    if results:
        if not any(r.reachable for r in results):
            log.info("peers cannot reach %s: %s", address, "; ".join(f"{r.prober[-8:]}: {r.detail}" for r in results))
        return any(r.reachable for r in results)
    if errors:
        log.warning("could not ask any peer to check our address: %s", "; ".join(errors))
    return None


async def decide_reach(mode: str, probe) -> str:
    """`direct` or `relayed` for network.reach = auto | direct | libp2p. `probe` is awaited for
    auto/direct; raises UnreachableAddress when direct was required and peers cannot reach us."""
    if mode == "libp2p":
        return "relayed"
    reachable = await probe()
    if reachable is False:
        if mode == "direct":
            raise UnreachableAddress("no peer could reach this node's announced address (network.reach = direct)")
        return "relayed"
    return "direct"


async def wait_for_replicas(directory: PeerDirectory, num_stages: int, count: int, timeout_s: float) -> None:
    """Block until every stage shows at least `count` live replicas (or raise TimeoutError)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        sizes = [len(await directory.replicas(s, fresh=True)) for s in range(num_stages)]
        if min(sizes) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas per stage {sizes}, waited for {count} each")
        await asyncio.sleep(0.25)


def contact_lookup(directory: PeerDirectory):
    """The dialer's lookup: a peer's current record as a transport Contact."""
    from noloco_node.transport.dialer import Contact

    async def lookup(peer_id: str):
        record = await directory.record_of(peer_id)
        if record is None:
            return None
        return Contact(record.peer_id, record.address, record.reach, record.tls_cert, tuple(record.p2p_addrs))
    return lookup


async def settle_reach(directory: PeerDirectory, links, cfg, *, address: str, server) -> None:
    """Direct TLS if live peers can dial `address` (and then relay for peers behind NAT);
    otherwise restart our libp2p daemon (in place) as a private peer holding reservations on
    static relays (the initial peers unless network.relays says otherwise), serve over the bridge,
    and dial out to the directly reachable peers so they reach us over our own connections. Two
    NATed peers reach each other through a relay's splice (transport/relay.py)."""
    net, timeouts = cfg.network, cfg.timeouts
    probe = lambda: probe_reachable(directory, links.dialer, address=address, peer_id=directory.peer_id,  # noqa: E731
                                    tls_cert=links.certificate.cert_der, num_stages=cfg.pipeline.num_stages,
                                    run_id=cfg.run.run_id, timeout_s=timeouts.connect_s)
    links.reach = await decide_reach(net.reach if net.check_reachability else "direct", probe)
    if links.reach == "direct":  # NATed peers dial these, so we can reach them without a relay
        links.p2p_addrs = [a for a in await directory.visible_maddrs() if "/ip4/127." not in a][:8]
        await links.serve_relay()
        return
    log.info("peers cannot dial %s: serving over libp2p (relay / hole punching) instead", address)
    relays = list(net.relays or net.initial_peers)
    # relayDiscovery=0 makes the trusted relays static: a reservation in ~0.2 s, not after 3 min.
    await directory.restart({"force_reachability": "private", "use_auto_relay": True, "trusted_relays": relays,
                             "daemon_flags": {"relayDiscovery": False}})
    await links.attach(directory.p2p, server.bridge_port, server.tls_target)
    links.p2p_addrs = await links.reserve_relays(relays, timeouts.relay_s)
    if not links.p2p_addrs:
        log.warning("no relay reservation within %.0f s: only peers we dial ourselves can call us", timeouts.relay_s)
    await links.bridge.dial_out(await public_libp2p_addrs(directory, cfg.pipeline.num_stages))


async def public_libp2p_addrs(directory: PeerDirectory, num_stages: int) -> dict[str, list[str]]:
    """Directly reachable peers and their libp2p addresses: a node behind NAT dials out to them so
    their calls to it run over that connection instead of a relay (whose circuits p2pd caps)."""
    return {r.peer_id: list(r.p2p_addrs) for s in range(num_stages) for r in await directory.replicas(s)
            if r.reach == "direct" and r.p2p_addrs and r.peer_id != directory.peer_id}


async def fetch_state(directory: PeerDirectory, client: OuterClient, compute: ComputeThread, state: OuterState,
                      inner: InnerOptimizer, *, stage: int, peer_id: str, timeout_s: float) -> dict | None:
    """Joining a stage that already has replicas: copy a random one's phi, m, Adam moments and
    counters (theta <- phi). Up to 3 donors are tried. Returns {donor, inner_step, outer_round},
    or None (no other replica, or none answered: the run's initial weights stay)."""
    donors = [r for r in await directory.replicas(stage, fresh=True) if r.peer_id != peer_id]
    random.Random(peer_id).shuffle(donors)
    for donor in donors[:3]:
        try:
            tensors, counters = await client.fetch_state(donor.peer_id, stage=stage, requester=peer_id, timeout_s=timeout_s,
                                                         expected=expected_tensors(state))
            step = await compute.run(import_state, state, inner, tensors, counters)
        except NodeError as exc:
            log.warning("state transfer from %s failed: %s", donor.peer_id[-8:], exc)
            continue
        outer_round = int(counters["outer_round"])
        log.info("joined at inner step %d, outer round %d with state from %s", step, outer_round, donor.peer_id[-8:])
        return {"donor": donor.peer_id, "inner_step": step, "outer_round": outer_round}
    if donors:
        log.warning("no donor answered; starting from the run's initial weights")
    return None
