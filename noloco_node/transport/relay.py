"""The swarm's own relay: public peers splice libp2p streams between two peers behind NAT.

Why not libp2p's circuit relay? hivemind's p2pd (v0.5.0.hivemind1) starts two circuit relay
services on one host: the one its -relayDataLimit / -relayTimeLimit flags configure, and a second
with go-libp2p's defaults (`Daemon.EnableRelayV2` calls `relay.New(host)`). Whichever registers
the hop protocol last serves every circuit, so a relayed connection is reset after 128 KiB per
direction (and 2 minutes) in most runs here: too little for one microbatch of a real model.

So the data plane between two NATed peers runs through this splice instead; libp2p still carries
each leg (encrypted, peer ids proven), and p2pd's relay reservations still keep each NATed peer
connected to its relays. The relay only moves bytes: the caller speaks TLS end to end to the
target's gRPC server, pinned to the certificate in the target's signed record, and signs every
call for the target (transport/credentials.py), so the relay can neither read nor forge a call.

    caller --libp2p "/noloco/relay/1"--> relay --libp2p "/noloco/relayed/1"--> target --TCP--> target's TLS port

Request (caller -> relay, one line): b"NLR1 <target peer id>\\n". Answer (relay -> caller, one
line): b"OK\\n", or b"NO <reason>\\n" and the stream ends. Then bytes flow both ways until either
side ends. A relay serves only targets that are connected to it (peers behind NAT that reserved a
slot or dialled out to it), at most MAX_PER_SOURCE circuits per caller and MAX_CIRCUITS in all,
a stream counted from its opening (its request line must come within the connect timeout);
a circuit whose caller sends nothing within the connect timeout after OK, or that carries nothing
either way for IDLE_S, is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

from hivemind.p2p import P2P, PeerID

from noloco_node.transport.splice import splice

log = logging.getLogger(__name__)

RELAY_PROTOCOL = "/noloco/relay/1"
RELAYED_PROTOCOL = "/noloco/relayed/1"
MAX_PER_SOURCE = 16
MAX_CIRCUITS = 128
BUSY_READ_S = 1.0
"""How long a stream over the caps may take to send its request line before it is told busy."""
IDLE_S = 45.0
"""A circuit that carries no byte either way for this long is closed (gRPC pings every 30 s)."""
_REQUEST_LIMIT = 128
_MAGIC = b"NLR1 "


class RelayRefused(ConnectionError):
    pass


def encode_request(target_peer_id: str) -> bytes:
    return _MAGIC + target_peer_id.encode() + b"\n"


async def read_line(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """One line of at most _REQUEST_LIMIT bytes (without its newline); raises RelayRefused."""
    try:
        line = await asyncio.wait_for(reader.readuntil(b"\n"), timeout_s)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError) as exc:
        raise RelayRefused(f"no complete line within {timeout_s:.0f} s ({type(exc).__name__})") from None
    if len(line) > _REQUEST_LIMIT:
        raise RelayRefused(f"line of {len(line)} bytes (limit {_REQUEST_LIMIT})")
    return line[:-1]


def parse_request(line: bytes) -> str:
    """The target peer id a relay request names; raises RelayRefused on anything malformed."""
    if not line.startswith(_MAGIC):
        raise RelayRefused("not a relay request (expected 'NLR1 <peer id>')")
    target = line[len(_MAGIC) :].decode("ascii", "replace")
    try:
        if not target or PeerID.from_base58(target).to_base58() != target:
            raise ValueError(target)
    except Exception:  # noqa: BLE001 - any decoding failure means the same thing
        raise RelayRefused(f"{target[:60]!r} is not a peer id") from None
    return target


async def ask_relay(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target_peer_id: str, timeout_s: float
) -> None:
    """The caller's side of the handshake; returns when the relay has opened the circuit."""
    writer.write(encode_request(target_peer_id))
    await writer.drain()
    answer = await read_line(reader, timeout_s)
    if answer != b"OK":
        raise RelayRefused(answer.decode("utf-8", "replace")[3:] or "refused")


class RelayService:
    """The public side: accepts `/noloco/relay/1` streams and splices each to its target."""

    def __init__(
        self,
        p2p: P2P,
        *,
        connect_timeout_s: float = 10.0,
        idle_s: float = IDLE_S,
        max_per_source: int = MAX_PER_SOURCE,
        max_circuits: int = MAX_CIRCUITS,
    ) -> None:
        self.p2p, self.connect_timeout_s, self.idle_s = p2p, connect_timeout_s, idle_s
        self.max_per_source, self.max_circuits = max_per_source, max_circuits
        self.active: Counter[str] = Counter()  # caller peer id -> open circuits
        self.circuits = 0
        self.bytes_relayed = 0
        self.refused: Counter[str] = Counter()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(RELAY_PROTOCOL, self._on_stream)

    async def close(self) -> None:
        try:
            await self.p2p.remove_binary_stream_handler(RELAY_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - the daemon may already be gone
            log.debug("relay handler not removed: %r", exc)

    def stats(self) -> dict:
        return {
            "circuits_open": sum(self.active.values()),
            "circuits_total": self.circuits,
            "bytes_relayed": self.bytes_relayed,
            "refused": dict(self.refused),
        }

    async def _refuse(self, writer: asyncio.StreamWriter, kind: str, why: str) -> None:
        self.refused[kind] += 1
        try:
            writer.write(b"NO " + why.encode()[:100] + b"\n")
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        writer.close()

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A stream counts against the caps from the moment it opens: counted only from its request
        # line, half-sent lines held streams past them for the whole read timeout (an audit's finding).
        source = info.peer_id.to_base58()
        if self.active[source] >= self.max_per_source or sum(self.active.values()) >= self.max_circuits:
            # Take the request line first (briefly): a stream closed under a caller's unread request
            # is reset, and the caller would read a lost connection instead of the answer.
            with contextlib.suppress(RelayRefused, ConnectionError, OSError):
                await read_line(reader, min(BUSY_READ_S, self.connect_timeout_s))
            return await self._refuse(
                writer,
                "busy",
                f"relay busy ({self.active[source]} circuits of yours, {sum(self.active.values())} in all)",
            )
        self.active[source] += 1
        try:
            await self._serve(source, reader, writer)
        except (ConnectionError, OSError) as exc:
            log.debug("relay stream from %s ended: %s", source[-8:], exc)
        finally:
            self.active[source] -= 1
            if self.active[source] <= 0:
                del self.active[source]

    async def _serve(self, source: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target = parse_request(await read_line(reader, self.connect_timeout_s))
        except RelayRefused as exc:
            return await self._refuse(writer, "malformed", str(exc))
        if target == source or target == self.p2p.peer_id.to_base58():
            return await self._refuse(writer, "malformed", "a relay circuit must name another peer")
        connected = {p.peer_id.to_base58() for p in await self.p2p.list_peers()}
        if target not in connected:
            return await self._refuse(writer, "not_connected", f"peer {target[-8:]} is not connected to this relay")
        try:
            _, down_reader, down_writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(target), RELAYED_PROTOCOL),
                self.connect_timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - the caller gets the reason
            return await self._refuse(
                writer, "target_failed", f"could not open a stream to {target[-8:]}: {type(exc).__name__}"
            )
        self.circuits += 1
        writer.write(b"OK\n")
        await writer.drain()
        await self._carry(source, target, (reader, writer), (down_reader, down_writer))

    async def _carry(self, source: str, target: str, caller: tuple, down: tuple) -> None:
        """Splice the circuit while it is used: the caller's first bytes (its TLS hello) within
        connect_timeout_s, and then some byte either way every idle_s (gRPC's keepalive pings
        every 30 s). A hostile-peer audit's 8 throwaway identities held all 128 circuits with
        streams that sent nothing, for two minutes at a time, and no one else got one."""
        loop = asyncio.get_running_loop()
        opened = loop.time()
        moved = {"caller": 0, "last": opened}

        def from_caller(n: int) -> None:
            self.bytes_relayed += n
            moved["caller"] += n
            moved["last"] = loop.time()

        def to_caller(n: int) -> None:
            self.bytes_relayed += n
            moved["last"] = loop.time()

        carrying = asyncio.ensure_future(splice(*caller, *down, from_caller, to_caller))
        try:
            while not carrying.done():
                await asyncio.wait([carrying], timeout=min(1.0, self.idle_s))
                now = loop.time()
                unused = not moved["caller"] and now - opened > self.connect_timeout_s
                if not carrying.done() and (unused or now - moved["last"] > self.idle_s):
                    self.refused["idle"] += 1
                    why = "unused" if unused else "idle"
                    log.debug("relay circuit %s -> %s closed: %s", source[-8:], target[-8:], why)
                    carrying.cancel()
        finally:
            if not carrying.done():
                carrying.cancel()
            await asyncio.gather(carrying, return_exceptions=True)


def relays_of(p2p_addrs: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """(relay peer id, relay multiaddr with /p2p/<id>) for each circuit address
    `<relay maddr>/p2p/<relay id>/p2p-circuit/p2p/<peer>` a record lists."""
    out = []
    for addr in p2p_addrs:
        relay, sep, _ = addr.partition("/p2p-circuit")
        if sep and "/p2p/" in relay:
            out.append((relay.rsplit("/p2p/", 1)[1], relay))
    return out
