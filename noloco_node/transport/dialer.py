"""How a peer is dialled: from what its signed record says to a gRPC channel.

- `direct`: TLS to the record's address, trusting only the certificate in the record.
- `holepunched` / `relayed`: gRPC over a libp2p stream (transport/bridge.py) to the record's peer
  id when our daemon holds a connection to it (hole-punched, or opened by the NATed peer);
  otherwise TLS (pinned as above) through one of the relays the record names (transport/relay.py).
Every call on every channel is signed for the peer we mean to reach (transport/credentials.py).
Channels are cached per peer and replaced when the peer's record changes how it is reached, and a
channel through a relay is replaced once our daemon holds a connection of its own to the peer
(checked at most every RELAYED_RECHECK_S).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from noloco_node.errors import PeerUnavailable, PeerUnknown
from noloco_node.transport.bridge import Libp2pBridge, PathTraffic
from noloco_node.transport.channels import open_channel
from noloco_node.transport.credentials import CallSigner
from noloco_node.transport.relay import relays_of
from noloco_node.transport.tls import CertificateError, pem_from_record, pinned_credentials

log = logging.getLogger(__name__)

RELAYED_RECHECK_S = 10.0
"""How often a channel through a relay asks whether a connection of our own to its peer appeared: a
NATed peer that dials out to us after we first reached it through the relay (a NAT audit's public
node kept sending through the bootstrap's relay, and stalled with it while the bootstrap restarted)."""


@dataclass(frozen=True)
class Contact:
    """What a peer's record says about reaching it."""

    peer_id: str
    address: str
    reach: str = "direct"
    tls_cert: str = ""
    p2p_addrs: tuple[str, ...] = ()


class Dialer:
    def __init__(
        self,
        signer: CallSigner,
        *,
        lookup: Callable[[str], Awaitable[Contact | None]],
        bridge: Libp2pBridge | None = None,
        options: list | None = None,
        traffic: PathTraffic | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.signer, self.lookup, self.bridge = signer, lookup, bridge
        self.options = list(options or [])
        self.traffic = traffic or (bridge.traffic if bridge is not None else PathTraffic())
        self._channels: dict[str, tuple[Contact, grpc.aio.Channel, str]] = {}
        self._relayed_checked: dict[str, float] = {}  # peer id -> when a relayed channel last checked
        self._spliced: set[str] = set()  # peers whose channel runs through a relay's splice
        self._retiring: dict[asyncio.Task, grpc.aio.Channel] = {}  # relayed channels closing once their calls end
        self.clock = clock

    async def channel(self, peer_id: str) -> tuple[grpc.aio.Channel, str]:
        """A channel to `peer_id` and the path it takes; raises PeerUnavailable when we know no
        way to reach it (no live record, or a record we cannot use)."""
        contact = await self.lookup(peer_id)
        if contact is None:
            raise PeerUnknown(f"no live record for peer {peer_id[-8:]}: cannot dial it")
        known = self._channels.get(peer_id)
        if known is not None and known[0] == contact:
            if not await self._own_connection_appeared(peer_id):
                return known[1], known[2]
            # The calls under way on the relayed channel finish there (a minute at most).
            retiring = asyncio.ensure_future(known[1].close(grace=60.0))
            self._retiring[retiring] = known[1]
            retiring.add_done_callback(lambda task: self._retiring.pop(task, None))
        elif known is not None:
            await known[1].close()
        channel, path = await self._open(contact)
        self._channels[peer_id] = (contact, channel, path)
        self._relayed_checked[peer_id] = self.clock()
        return channel, path

    def _through_relay(self, peer_id: str) -> bool:
        """Whether the cached channel to `peer_id` runs through a relay's splice (a channel over a
        connection of our own carries the record's reach, `relayed` too, as its path)."""
        return peer_id in self._spliced

    async def _open(self, contact: Contact) -> tuple[grpc.aio.Channel, str]:
        if contact.reach == "direct":
            try:
                credentials = pinned_credentials(pem_from_record(contact.tls_cert))
            except CertificateError as exc:
                raise PeerUnavailable(f"peer {contact.peer_id[-8:]} publishes no usable certificate: {exc}") from None
            return open_channel(
                contact.address, self.signer, contact.peer_id, credentials=credentials, options=self.options
            ), "direct"
        if self.bridge is None:
            raise PeerUnavailable(f"peer {contact.peer_id[-8:]} is reached over libp2p, which this client lacks")
        relays = relays_of(contact.p2p_addrs)
        if relays and await self.via_relay(contact):
            # No libp2p connection of our own to the peer: through a relay's splice, TLS end to end.
            try:
                credentials = pinned_credentials(pem_from_record(contact.tls_cert))
            except CertificateError as exc:
                raise PeerUnavailable(f"peer {contact.peer_id[-8:]} publishes no usable certificate: {exc}") from None
            target = await self.bridge.relay_endpoint(contact.peer_id, relays)
            self._spliced.add(contact.peer_id)
            return open_channel(
                target, self.signer, contact.peer_id, credentials=credentials, options=self.options
            ), "relayed"
        self._spliced.discard(contact.peer_id)
        target = await self.bridge.endpoint(contact.peer_id, contact.p2p_addrs)
        # Keepalive pings stay as configured; the libp2p link below has its own.
        return open_channel(target, self.signer, contact.peer_id, options=self.options), contact.reach

    async def _own_connection_appeared(self, peer_id: str) -> bool:
        if not self._through_relay(peer_id) or self.bridge is None:
            return False
        now = self.clock()
        if now - self._relayed_checked.get(peer_id, now) < RELAYED_RECHECK_S:
            return False
        self._relayed_checked[peer_id] = now
        if await self.bridge.connection_path(peer_id) != "holepunched":
            return False
        log.info("peer %s: a connection of our own to it appeared; leaving the relay", peer_id[-8:])
        return True

    async def via_relay(self, contact: Contact) -> bool:
        """Whether to reach a peer behind NAT through a relay's splice: yes unless our daemon holds
        a direct libp2p connection to it (hole-punched, or one it opened to us)."""
        return await self.bridge.connection_path(contact.peer_id) != "holepunched"

    def count_sent(self, path: str, nbytes: int) -> None:
        """Payload bytes sent on the direct path (libp2p paths are counted by the bridge itself)."""
        if path == "direct":
            self.traffic.add("direct", "out", nbytes)

    async def use_bridge(self, bridge: Libp2pBridge) -> None:
        """Dial libp2p peers over `bridge` from now on (the daemon was restarted): channels over the
        old one are dead and are closed."""
        self.bridge = bridge
        await self.close()

    async def close(self) -> None:
        for _, channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._spliced.clear()
        for retiring, channel in list(self._retiring.items()):
            retiring.cancel()
            await channel.close()
