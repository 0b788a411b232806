"""A node's links, in one place: its identity, its TLS certificate, the signing and checking of
calls, the libp2p bridge and the dialer. the node assembly builds one and hands its parts to the server,
the clients and the admission interceptor; nothing here knows models or the DHT's records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from noloco_node.runtime.node_stats import LinkStats
from noloco_node.transport.bridge import Libp2pBridge, PathTraffic
from noloco_node.transport.credentials import CallSigner, CallVerifier
from noloco_node.transport.dialer import Contact, Dialer
from noloco_node.transport.identity import NodeIdentity
from noloco_node.transport.relay import RelayService
from noloco_node.transport.tls import NodeCertificate

log = logging.getLogger(__name__)


class Links:
    def __init__(
        self,
        identity: NodeIdentity,
        *,
        swarm_key: bytes | None,
        max_skew_s: float,
        lookup: Callable[[str], Awaitable[Contact | None]] | None = None,
        options: list | None = None,
    ) -> None:
        self.identity = identity
        self.certificate = NodeCertificate.generate()
        self.signer = CallSigner(identity, swarm_key)
        self.verifier = CallVerifier(identity.peer_id, swarm_key=swarm_key, max_skew_s=max_skew_s)
        self.traffic = PathTraffic()
        self.bridge: Libp2pBridge | None = None
        self.relay: RelayService | None = None
        self._lookup = lookup
        self.dialer = Dialer(self.signer, lookup=self._find, traffic=self.traffic, options=options)
        self.reach = "direct"
        self.p2p_addrs: list[str] = []
        self._seen = (0, 0)  # (holepunched, relayed) bytes at the last reach update

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def _find(self, peer_id: str) -> Contact | None:
        return None if self._lookup is None else await self._lookup(peer_id)

    def origin(self, grpc_peer: str) -> tuple[str, str] | None:
        """For the admission interceptor: the libp2p peer behind a bridged loopback connection."""
        return None if self.bridge is None else self.bridge.origin(grpc_peer)

    async def attach(self, p2p, grpc_bridge_port: int, tls_target: tuple[str, int] | None = None) -> None:
        """Serve and dial over `p2p` (again, after the daemon was restarted in relay mode).
        `tls_target` (host, port of our TLS listener) lets relays splice callers to it."""
        if self.bridge is not None:
            await self.bridge.close()
        if self.relay is not None:  # a restarted daemon serves no relay until serve_relay() again
            await self.relay.close()
            self.relay = None
        self.bridge = Libp2pBridge(p2p, traffic=self.traffic)
        await self.bridge.serve(grpc_bridge_port, tls_target)
        await self.dialer.use_bridge(self.bridge)

    async def dial_over(self, p2p) -> None:
        """Reach libp2p peers (NATed, relayed) over `p2p` without serving anything: for clients."""
        self.bridge = Libp2pBridge(p2p, traffic=self.traffic)
        await self.dialer.use_bridge(self.bridge)

    async def serve_relay(self) -> RelayService:
        """Relay for peers behind NAT (a directly reachable node does; see transport/relay.py)."""
        if self.relay is None and self.bridge is not None:
            self.relay = RelayService(self.bridge.p2p)
            await self.relay.start()
        return self.relay

    def update_reach(self) -> str:
        """For a node that is not directly reachable: `holepunched` when everything libp2p carried
        since the last update went over direct (hole-punched or reversed) connections, `relayed`
        when any of it crossed a relay; unchanged when nothing moved."""
        if self.reach == "direct":
            return self.reach
        now = (
            self.traffic.bytes[("holepunched", "in")] + self.traffic.bytes[("holepunched", "out")],
            self.traffic.bytes[("relayed", "in")] + self.traffic.bytes[("relayed", "out")],
        )
        punched, relayed = now[0] - self._seen[0], now[1] - self._seen[1]
        self._seen = now
        if relayed > 0:
            self.reach = "relayed"
        elif punched > 0:
            self.reach = "holepunched"
        return self.reach

    def stats_view(self) -> LinkStats:
        """How peers reach the node, the bytes per path, the bridge's streams and what it relayed."""
        bridge = self.bridge
        return LinkStats(
            reach=self.reach,
            p2p_addrs=list(self.p2p_addrs),
            bytes_by_path=self.traffic.as_dict(),
            replayed_tokens=self.verifier.replays,
            streams_in=bridge.streams_in if bridge else 0,
            streams_out=bridge.streams_out if bridge else 0,
            streams_refused_in=bridge.refused_in if bridge else 0,
            relay_served=self.relay.stats() if self.relay is not None else None,
        )

    async def reserve_relays(self, relays: list[str], timeout_s: float) -> list[str]:
        """Our circuit addresses (`<relay>/p2p-circuit/p2p/<us>`) through every relay our daemon
        is connected to within `timeout_s`; its auto-relay client makes the reservation over that
        connection. p2pd does not list circuit addresses among its own, so they are built here."""
        wanted = {r.rsplit("/p2p/", 1)[-1]: r for r in relays if "/p2p/" in r}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.bridge is not None:
            connected = {p.peer_id.to_base58() for p in await self.bridge.p2p.list_peers()}
            ready = [addr for peer, addr in wanted.items() if peer in connected]
            if ready:
                await asyncio.sleep(1.0)  # the reservation follows the connection (~0.2 s measured)
                return [f"{addr}/p2p-circuit/p2p/{self.peer_id}" for addr in ready]
            await asyncio.sleep(0.25)
        return []

    async def close(self) -> None:
        try:
            await self.dialer.close()
            if self.relay is not None:
                await self.relay.close()
        finally:  # what holds files (the bridge's socket folder, the identity's) is closed whatever failed
            try:
                if self.bridge is not None:
                    await self.bridge.close()
            finally:
                self.identity.close()
