"""The steps of joining a running swarm, before a node announces itself: find out how peers can
reach us (the stage's training state is copied by node/state_copy.py).

Reachability never guesses. A node is `direct` only when a peer proved it can dial the announced
TLS address (Diagnostics.Probe: live direct replicas first, then the initial peers, which a
`noloco-node bootstrap` answers over libp2p). When no peer could dial it, or nobody could be asked,
or the address is a loopback one while the peers are on other machines, the node takes the relayed
path (gRPC over libp2p, a relay slot on the initial peers) and, unless it can never be dialled,
asks again every network.reprobe_s (doubling up to 16x); the first probe that reaches it moves it
to `direct` at runtime (libp2p daemon restarted in public mode, a fresh record announced)."""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable

from noloco_node.dht.directory import PeerDirectory
from noloco_node.errors import UnreachableAddress
from noloco_node.transport.addresses import is_loopback, maddr_host

log = logging.getLogger(__name__)


def announced_address(host: str, port: int, announce_addr: str | None, visible_maddrs: list[str]) -> str:
    """host:port peers should dial: the configured one; else, binding every interface, our IP as
    the DHT peers see it (the first non-loopback /ip4 address libp2p observed), else host:port.
    A loopback result is never announced as `direct` to peers on other machines (decide_reach)."""
    if announce_addr:
        return announce_addr
    if host in ("0.0.0.0", "::", ""):
        for maddr in visible_maddrs:
            parts = maddr.split("/")
            if len(parts) > 2 and parts[1] == "ip4" and not parts[2].startswith("127."):
                return f"{parts[2]}:{port}"
        return f"127.0.0.1:{port}"
    return f"{host}:{port}"


def loopback_to_remote_peers(address: str, peers: Iterable[str]) -> bool:
    """Whether `address` (host:port) is a loopback address while some of `peers` (multiaddrs: the
    initial peers and relays) are on other machines, which can never dial it."""
    hosts = [h for h in map(maddr_host, peers) if h is not None]
    return is_loopback(address.rpartition(":")[0]) and any(not is_loopback(h) for h in hosts)


def peer_ids_of(maddrs: Iterable[str]) -> list[str]:
    """The peer ids multiaddrs end in (`.../p2p/<id>`), in order, once each."""
    ids = [m.rsplit("/p2p/", 1)[1].split("/")[0] for m in maddrs if "/p2p/" in m]
    return list(dict.fromkeys(i for i in ids if i))


async def probe_reachable(
    directory: PeerDirectory,
    dialer,
    *,
    address: str,
    tls_cert: bytes,
    peer_id: str,
    num_stages: int,
    run_id: str,
    timeout_s: float,
    initial_peers: Iterable[str] = (),
) -> bool | None:
    """Ask up to four peers to dial `address` (our TLS health endpoint): live direct replicas
    first, then the initial peers (public by definition; a bootstrap answers probes over libp2p).
    True if one could, False if peers answered and none could, None when nobody could be asked."""
    from noloco_node.rpc.diagnostics import other_run, probe_from_peers

    peers = [
        r.peer_id
        for s in range(num_stages)
        for r in await directory.replicas(s, fresh=True)
        if r.peer_id != peer_id and r.reach == "direct"
    ]
    random.Random(peer_id).shuffle(peers)
    peers += [p for p in peer_ids_of(initial_peers) if p != peer_id and p not in peers]
    for attempt in range(2):
        # Once more with twice the deadline when no prober answered at all (a loaded machine):
        # an unanswered probe would otherwise read as "nobody to ask".
        results, errors = await probe_from_peers(
            address, peers[:4], run_id=run_id, timeout_s=timeout_s * (1 + attempt), dialer=dialer, tls_cert=tls_cert
        )
        if results or not errors:
            break
    if results:
        reached = [r.prober[-8:] for r in results if r.reachable]
        if reached:
            log.info("peers %s reached %s: they dial us directly", ", ".join(reached), address)
        else:
            log.info("peers cannot reach %s: %s", address, "; ".join(f"{r.prober[-8:]}: {r.detail}" for r in results))
        return bool(reached)
    if (theirs := other_run(errors)) is not None:
        # A bootstrap given another config (an audit's `docker run ... bootstrap` without --config)
        # answers probes for its own run only: our address is unchecked, not unreachable.
        log.warning(
            "could not have our address checked: the peers asked serve run %r, this node run %r (the bootstrap "
            "needs the swarm's config: --config); serving over libp2p until a peer of this run can check it",
            theirs,
            run_id,
        )
        return None
    log.warning("could not ask any peer to check our address: %s", "; ".join(errors) or "no peer to ask")
    return None


async def decide_reach(
    mode: str, probe: Callable[[], Awaitable[bool | None]], *, address: str, peers: Iterable[str] = ()
) -> str:
    """`direct` or `relayed` for network.reach = auto | direct | libp2p, or `declared` (the
    operator turned network.check_reachability off: direct without asking). `direct` only on
    proof (a peer dialled `address`) or declaration; never a loopback address while `peers`
    (initial peers, relays) are on other machines. Raises UnreachableAddress when direct was
    required and cannot be."""
    if mode == "libp2p":
        return "relayed"
    if loopback_to_remote_peers(address, peers):
        if mode in ("direct", "declared"):
            raise UnreachableAddress(
                f"{address} is a loopback address and the initial peers are on other machines (network.reach = {mode})"
            )
        log.info(
            "%s is a loopback address and the initial peers are on other machines: serving over libp2p; "
            "to be dialled directly, bind --host 0.0.0.0, forward --port and pass --announce-addr",
            address,
        )
        return "relayed"
    if mode == "declared":
        return "direct"
    reachable = await probe()
    if reachable:
        return "direct"
    if mode == "direct":
        if reachable is False:
            raise UnreachableAddress("no peer could reach this node's announced address (network.reach = direct)")
        log.warning("nobody could check %s; network.reach = direct: announcing it unproven", address)
        return "direct"
    return "relayed"


class Reprobe:
    """A relayed node's later probes: the first after `period_s`, each failed one doubling the wait
    (up to 16 x period_s); the first success awaits `go_direct` and ends the probing. The heartbeat
    asks `due()` and runs `run()` as a task of its own, so a slow probe never delays a heartbeat."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[bool | None]],
        go_direct: Callable[[], Awaitable[None]],
        *,
        period_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe, self._go_direct, self._clock = probe, go_direct, clock
        self.period_s = self._wait_s = period_s
        self._next = clock() + period_s
        self._running = False
        self.probes = 0
        self.switched = False

    def due(self) -> bool:
        return not self._running and not self.switched and self._clock() >= self._next

    async def run(self) -> bool:
        """One probe (and the switch when it succeeds); True once switched to direct."""
        self._running = True
        try:
            self.probes += 1
            if await self._probe():
                await self._go_direct()
                self.switched = True
                return True
        except Exception:  # noqa: BLE001 - a failed probe or switch is tried again later
            log.exception("re-probe of our address failed")
        finally:
            self._running = False
        self._wait_s = min(2 * self._wait_s, 16 * self.period_s)
        self._next = self._clock() + self._wait_s
        log.info("still not reachable directly; asking again in %.0f s", self._wait_s)
        return False


def contact_lookup(directory: PeerDirectory):
    """The dialer's lookup: a peer's current record as a transport Contact; an initial peer with no
    record (a bootstrap) is reached over libp2p at the multiaddr it was given as."""
    from noloco_node.transport.dialer import Contact

    async def lookup(peer_id: str):
        record = await directory.record_of(peer_id)
        if record is not None:
            return Contact(record.peer_id, record.address, record.reach, record.tls_cert, tuple(record.p2p_addrs))
        addrs = tuple(m for m in directory.initial_peers if peer_ids_of([m]) == [peer_id])
        # Not a circuit address, so the dialer opens a libp2p stream to the peer itself.
        return Contact(peer_id, "", "holepunched", "", addrs) if addrs else None

    return lookup


async def settle_reach(
    directory: PeerDirectory, links, cfg, *, address: str, server, announce: Callable[[], Awaitable[None]] | None = None
) -> Reprobe | None:
    """Direct TLS if a peer proved it can dial `address` (and then relay for peers behind NAT);
    otherwise the relayed path (go_relayed). Returns the Reprobe that may move the node to direct
    later (None when it is direct, reach = libp2p, or its address is loopback to remote peers);
    `announce` publishes our record (refreshed before the switch, then the one that says direct)."""
    net = cfg.network
    peers = [*net.initial_peers, *net.relays]
    probe = functools.partial(
        probe_reachable,
        directory,
        links.dialer,
        address=address,
        peer_id=directory.peer_id,
        tls_cert=links.certificate.cert_der,
        num_stages=cfg.pipeline.num_stages,
        run_id=cfg.run.run_id,
        timeout_s=cfg.timeouts.connect_s,
        initial_peers=net.initial_peers,
    )
    mode = net.reach if net.check_reachability else "declared"
    if await decide_reach(mode, probe, address=address, peers=peers) == "direct":
        await _serve_direct(directory, links)
        return None
    await go_relayed(directory, links, cfg, server)
    if mode != "auto" or net.reprobe_s <= 0 or loopback_to_remote_peers(address, peers):
        return None
    log.info("not reachable at %s (yet): asking peers again in %.0f s", address, net.reprobe_s)
    return Reprobe(probe, functools.partial(go_direct, directory, links, cfg, server, announce), period_s=net.reprobe_s)


async def _serve_direct(directory: PeerDirectory, links) -> None:
    links.reach = "direct"
    # NATed peers dial these, so we can reach them without a relay.
    links.p2p_addrs = [a for a in await directory.visible_maddrs() if "/ip4/127." not in a][:8]
    await links.serve_relay()


async def go_relayed(directory: PeerDirectory, links, cfg, server) -> None:
    """Restart our libp2p daemon (in place) as a private peer holding reservations on static relays
    (the initial peers unless network.relays says otherwise), serve over the bridge, and dial out
    to the directly reachable peers so they reach us over our own connections. Two NATed peers
    reach each other through a relay's splice (transport/relay.py)."""
    net, timeouts = cfg.network, cfg.timeouts
    log.info("peers cannot dial us directly: serving over libp2p (relay / hole punching)")
    links.reach = "relayed"
    relays = list(net.relays or net.initial_peers)
    # relayDiscovery=0 makes the trusted relays static: a reservation in ~0.2 s, not after 3 min.
    await directory.restart(
        {
            "force_reachability": "private",
            "use_auto_relay": True,
            "trusted_relays": relays,
            "daemon_flags": {"relayDiscovery": False},
        }
    )
    await links.attach(directory.p2p, server.bridge_port, server.tls_target)
    links.p2p_addrs = await links.reserve_relays(relays, timeouts.relay_s)
    if not links.p2p_addrs:
        log.warning("no relay reservation within %.0f s: only peers we dial ourselves can call us", timeouts.relay_s)
    await links.bridge.dial_out(await public_libp2p_addrs(directory, cfg.pipeline.num_stages))


async def go_direct(
    directory: PeerDirectory, links, cfg, server, announce: Callable[[], Awaitable[None]] | None
) -> None:
    """A peer reached us: restart our libp2p daemon in public mode (as a node that started direct
    runs it), serve over it, relay for NATed peers, and announce the record that says `direct`.
    If the restart fails the node goes back to the relayed path."""
    log.info("a peer reached our address: switching to direct")
    if announce is not None:
        # The restart skips heartbeats: refresh our (relayed) record so it lives a whole
        # record_ttl_s from here. Not longer: the DHT keeps the record that expires last, so a
        # longer-lived one would hide every update after it until it expired.
        await announce()
    try:
        await directory.restart({})
        await links.attach(directory.p2p, server.bridge_port, server.tls_target)
    except Exception:
        log.exception("could not restart libp2p in public mode; staying relayed")
        await go_relayed(directory, links, cfg, server)
        raise
    await _serve_direct(directory, links)
    if announce is not None:
        await announce()
    log.info("peers now dial us directly")


async def public_libp2p_addrs(directory: PeerDirectory, num_stages: int) -> dict[str, list[str]]:
    """Directly reachable peers and their libp2p addresses: a node behind NAT dials out to them so
    their calls to it run over that connection instead of a relay (whose circuits p2pd caps)."""
    return {
        r.peer_id: list(r.p2p_addrs)
        for s in range(num_stages)
        for r in await directory.replicas(s)
        if r.reach == "direct" and r.p2p_addrs and r.peer_id != directory.peer_id
    }
