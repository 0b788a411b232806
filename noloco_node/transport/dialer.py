"""How a peer is dialled: from what its signed record says to a gRPC channel.

- `direct`: TLS to the record's address, trusting only the certificate in the record.
- `holepunched` / `relayed`: gRPC over a libp2p stream (transport/bridge.py) to the record's peer
  id when our daemon holds a connection to it (hole-punched, or opened by the NATed peer);
  otherwise TLS (pinned as above) through one of the relays the record names (transport/relay.py).
Every call on every channel is signed for the peer we mean to reach (transport/credentials.py).
Channels are cached per peer and replaced when the peer's record changes how it is reached.
"""

from __future__ import annotations

import logging
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
    ) -> None:
        self.signer, self.lookup, self.bridge = signer, lookup, bridge
        self.options = list(options or [])
        self.traffic = traffic or (bridge.traffic if bridge is not None else PathTraffic())
        self._channels: dict[str, tuple[Contact, grpc.aio.Channel, str]] = {}

    async def channel(self, peer_id: str) -> tuple[grpc.aio.Channel, str]:
        """A channel to `peer_id` and the path it takes; raises PeerUnavailable when we know no
        way to reach it (no live record, or a record we cannot use)."""
        contact = await self.lookup(peer_id)
        if contact is None:
            raise PeerUnknown(f"no live record for peer {peer_id[-8:]}: cannot dial it")
        known = self._channels.get(peer_id)
        if known is not None and known[0] == contact:
            return known[1], known[2]
        if known is not None:
            await known[1].close()
        channel, path = await self._open(contact)
        self._channels[peer_id] = (contact, channel, path)
        return channel, path

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
            return open_channel(
                target, self.signer, contact.peer_id, credentials=credentials, options=self.options
            ), "relayed"
        target = await self.bridge.endpoint(contact.peer_id, contact.p2p_addrs)
        # Keepalive pings stay as configured; the libp2p link below has its own.
        return open_channel(target, self.signer, contact.peer_id, options=self.options), contact.reach

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
