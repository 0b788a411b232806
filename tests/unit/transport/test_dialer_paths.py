"""A channel through a relay gives way to a connection of our own once the NATed peer dials out to
us: a NAT audit's public node kept sending to a home volunteer through the bootstrap's relay (it had
reached it before the volunteer dialled out), and stalled with the relay while the bootstrap restarted."""

import asyncio

from noloco_node.transport.dialer import RELAYED_RECHECK_S, Contact, Dialer
from noloco_node.transport.identity import NodeIdentity
from noloco_node.transport.tls import NodeCertificate

RELAY = NodeIdentity.generate().peer_id
PEER = NodeIdentity.generate().peer_id


class Bridge:
    """Stands in for transport/bridge.py: endpoints are made-up unix sockets, nothing is dialled."""

    def __init__(self) -> None:
        self.path: str | None = None  # how our daemon is connected to PEER
        self.traffic = None

    async def connection_path(self, peer_id: str) -> str | None:
        return self.path

    async def relay_endpoint(self, peer_id: str, relays) -> str:
        return "unix:/nonexistent/relayed.sock"

    async def endpoint(self, peer_id: str, addrs=()) -> str:
        return "unix:/nonexistent/own.sock"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def relayed_dialer() -> tuple[Dialer, Bridge, Clock]:
    """A dialer whose one peer's record says `relayed`, through RELAY's circuit."""
    contact = Contact(
        PEER,
        "127.0.0.1:1",
        "relayed",
        NodeCertificate.generate().b64,
        (f"/ip4/198.18.0.1/tcp/31330/p2p/{RELAY}/p2p-circuit/p2p/{PEER}",),
    )

    async def lookup(peer_id):
        return contact

    bridge, clock = Bridge(), Clock()
    return Dialer(None, lookup=lookup, bridge=bridge, clock=clock), bridge, clock


def test_a_relayed_channel_is_replaced_once_a_connection_of_our_own_appears():
    async def scenario():
        dialer, bridge, clock = relayed_dialer()
        first, path = await dialer.channel(PEER)
        assert path == "relayed" and dialer._through_relay(PEER)
        clock.now += RELAYED_RECHECK_S / 2
        bridge.path = "holepunched"  # the volunteer dialled out to us
        assert await dialer.channel(PEER) == (first, "relayed")  # not checked again yet
        clock.now += RELAYED_RECHECK_S
        second, path = await dialer.channel(PEER)
        assert second is not first and not dialer._through_relay(PEER)
        clock.now += 10 * RELAYED_RECHECK_S
        assert (await dialer.channel(PEER))[0] is second  # a path of our own stays
        await dialer.close()

    asyncio.run(scenario())


def test_a_relayed_channel_stays_while_no_connection_of_our_own_exists():
    async def scenario():
        dialer, bridge, clock = relayed_dialer()
        first, _ = await dialer.channel(PEER)
        bridge.path = "relayed"  # connected, but only through a relay
        clock.now += 2 * RELAYED_RECHECK_S
        assert await dialer.channel(PEER) == (first, "relayed")
        await dialer.close()

    asyncio.run(scenario())
