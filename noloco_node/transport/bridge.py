"""gRPC over libp2p: the same services, the same HTTP/2 bytes, carried on a libp2p stream.

A node that cannot be dialled directly is reached through its libp2p daemon (hivemind's p2pd):
over a libp2p connection between the two peers (hole-punched, or opened by the NATed side), or,
between two NATed peers, through a public peer's relay splice (transport/relay.py). The bridge
keeps gRPC as the one definition of the protocol by moving bytes, not messages:

    caller's gRPC channel -> unix socket (private dir) -> [bridge] -> libp2p stream "/noloco/grpc/1"
      -> callee's p2pd -> [bridge] -> TCP 127.0.0.1:<plaintext bridge port> -> callee's gRPC server

libp2p encrypts the link (TLS 1.3 or Noise) and its handshake proves the remote peer id. The callee
records which libp2p peer each of its loopback connections carries, so the admission interceptor
can require the call's signed identity to be that same peer (rpc/admission.py). Through a relay
the caller's channel is TLS, pinned to the callee's certificate, end to end to the callee's TLS
port ("/noloco/relayed/1"): the relay carries ciphertext, and the call's signature proves the caller.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from noloco_node.transport.bridge_dirs import make_bridge_dir
from noloco_node.transport.relay import RELAY_PROTOCOL, RELAYED_PROTOCOL, RelayRefused, ask_relay
from noloco_node.transport.splice import splice

log = logging.getLogger(__name__)

PROTOCOL = "/noloco/grpc/1"


def path_of(addr: object) -> str:
    """How a libp2p connection runs: through a circuit relay, or directly (hole-punched, or a
    connection the NATed side opened itself)."""
    return "relayed" if "p2p-circuit" in str(addr) else "holepunched"


class DaemonMaddr:
    """A multiaddr as p2pd's go-multiaddr reads it. hivemind's Multiaddr.to_bytes() writes a
    /p2p/<id> component as a CIDv1, which p2pd rejects ("length greater than remaining number of
    bytes in buffer"), so circuit addresses (<relay>/p2p/<id>/p2p-circuit/p2p/<id>) could not be
    handed to the daemon; go-multiaddr wants the raw multihash."""

    def __init__(self, text: str) -> None:
        self.text = text

    def to_bytes(self) -> bytes:
        import base58
        import varint

        out = b""
        for i, part in enumerate(self.text.split("/p2p/")):
            if i > 0:
                peer_id, _, rest = part.partition("/")
                digest = base58.b58decode(peer_id)
                out += varint.encode(421) + varint.encode(len(digest)) + digest  # 421: the p2p protocol code
                part = "/" + rest if rest else ""
            if part:
                out += Multiaddr(part).to_bytes()
        return out

    def __str__(self) -> str:
        return self.text


class PathTraffic:
    """Bytes per path and direction, for /metrics and stats."""

    def __init__(self) -> None:
        self.bytes: Counter[tuple[str, str]] = Counter()  # (path, "in"|"out") -> bytes

    def add(self, path: str, direction: str, n: int) -> None:
        self.bytes[(path, direction)] += n

    def as_dict(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (path, direction), n in sorted(self.bytes.items()):
            out.setdefault(path, {})[direction] = n
        return out


class Libp2pBridge:
    def __init__(
        self,
        p2p: P2P,
        *,
        traffic: PathTraffic | None = None,
        connect_timeout_s: float = 10.0,
        max_streams_in: int = 256,
    ) -> None:
        self.p2p = p2p
        self.traffic = traffic or PathTraffic()
        self.connect_timeout_s = connect_timeout_s
        # (host, port) of our side of a connection into our gRPC server -> (libp2p peer id, path)
        self._origins: dict[tuple[str, int], tuple[str, str]] = {}
        self._grpc_port: int | None = None
        self._tls_target: tuple[str, int] | None = None
        self._dir = make_bridge_dir()  # private to this user, and swept once this process is gone
        self._endpoints: dict[tuple[str, str], tuple[asyncio.AbstractServer, str]] = {}
        self._addrs: dict[str, list[str]] = {}
        self._relays: dict[str, list[tuple[str, str]]] = {}
        self.max_streams_in = max_streams_in
        self.open_in = 0
        self.streams_in = 0
        self.streams_out = 0
        self.refused_in = 0

    # ---- serving: libp2p streams in, to our gRPC server ---------------------------------
    async def serve(self, grpc_port: int, tls_target: tuple[str, int] | None = None) -> None:
        """Accept libp2p streams for our gRPC server: "/noloco/grpc/1" to its plaintext port
        (127.0.0.1:grpc_port, where admission checks the call against the peer libp2p proved) and,
        with `tls_target` (host, port of its TLS listener), "/noloco/relayed/1" from a relay to the
        TLS port (end-to-end TLS; the call's signature proves the caller)."""
        self._grpc_port, self._tls_target = grpc_port, tls_target
        await self.p2p.add_binary_stream_handler(PROTOCOL, self._on_stream)
        if tls_target is not None:
            await self.p2p.add_binary_stream_handler(RELAYED_PROTOCOL, self._on_relayed)

    def origin(self, grpc_peer: str) -> tuple[str, str] | None:
        """(libp2p peer id, path) of a connection the bridge made, as gRPC names its client end
        (`ipv4:127.0.0.1:PORT`); None for any other connection."""
        host, _, port = grpc_peer.rpartition(":")
        kind, _, host = host.partition(":")
        if kind not in ("ipv4", "ipv6") or not port.isdigit():
            return None
        return self._origins.get((host.strip("[]"), int(port)))

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._deliver(
            info.peer_id.to_base58(), path_of(info.addr), ("127.0.0.1", self._grpc_port), reader, writer
        )

    async def _on_relayed(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._deliver(info.peer_id.to_base58(), "relayed", self._tls_target, reader, writer)

    async def _deliver(self, peer_id: str, path: str, server: tuple[str, int], reader, writer) -> None:
        if self.open_in >= self.max_streams_in:
            self.refused_in += 1
            writer.close()
            return
        self.streams_in += 1
        self.open_in += 1
        try:
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*server), self.connect_timeout_s)
            except (OSError, asyncio.TimeoutError):
                writer.close()
                return
            local = up_writer.get_extra_info("sockname")[:2]
            # Registered before a byte is forwarded, so gRPC cannot see the call before its origin.
            self._origins[local] = (peer_id, path)
            try:
                await splice(
                    reader,
                    writer,
                    up_reader,
                    up_writer,
                    lambda n: self.traffic.add(path, "in", n),
                    lambda n: self.traffic.add(path, "out", n),
                )
            finally:
                # gRPC may still be finishing calls of this connection: forget its origin a little later.
                asyncio.get_running_loop().call_later(30.0, self._origins.pop, local, None)
        finally:
            self.open_in -= 1

    # ---- dialling: our gRPC channels out, over libp2p -----------------------------------
    async def endpoint(self, peer_id: str, addrs: list[str] | tuple[str, ...] = ()) -> str:
        """A gRPC target (unix socket) whose connections are carried to `peer_id` over libp2p
        (a connection between us, which the NATed side may have opened, or a libp2p circuit)."""
        if addrs:
            self._addrs[peer_id] = list(addrs)
        return await self._endpoint("libp2p", peer_id, self._on_local)

    async def relay_endpoint(self, peer_id: str, relays: list[tuple[str, str]]) -> str:
        """A gRPC target whose connections reach `peer_id`'s TLS port through one of `relays`
        ((relay peer id, relay multiaddr)), tried in random order (transport/relay.py). The channel
        on top must be TLS, pinned to `peer_id`'s certificate: the relay sees only ciphertext."""
        self._relays[peer_id] = list(relays)
        return await self._endpoint("relay", peer_id, self._on_local_relayed)

    async def _endpoint(self, kind: str, peer_id: str, handler) -> str:
        known = self._endpoints.get((kind, peer_id))
        if known is not None:
            return known[1]
        sock = str(Path(self._dir.name) / f"{len(self._endpoints)}.sock")
        server = await asyncio.start_unix_server(lambda r, w: handler(peer_id, r, w), path=sock)
        target = f"unix:{sock}"
        self._endpoints[(kind, peer_id)] = (server, target)
        return target

    async def _connect(self, peer: PeerID, addrs: list[str]) -> None:
        if addrs:
            try:  # teach our daemon where the peer is
                await asyncio.wait_for(
                    self.p2p._client.connect(peer, [DaemonMaddr(a) for a in addrs]), self.connect_timeout_s
                )
            except Exception as exc:  # noqa: BLE001 - the stream open after this reports the real failure
                log.debug("connect to %s via %s failed: %s", peer.to_base58()[-8:], addrs, exc)

    async def _open(self, peer_id: str):
        peer = PeerID.from_base58(peer_id)
        await self._connect(peer, self._addrs.get(peer_id, []))
        return await asyncio.wait_for(self.p2p.call_binary_stream_handler(peer, PROTOCOL), self.connect_timeout_s)

    async def _on_local(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            info, remote_reader, remote_writer = await self._open(peer_id)
        except Exception as exc:  # noqa: BLE001 - the gRPC call on top sees UNAVAILABLE
            log.info("libp2p stream to %s failed: %s", peer_id[-8:], exc)
            writer.close()
            return
        self.streams_out += 1
        path = path_of(info.addr)
        await splice(
            reader,
            writer,
            remote_reader,
            remote_writer,
            lambda n: self.traffic.add(path, "out", n),
            lambda n: self.traffic.add(path, "in", n),
        )

    async def _open_relayed(self, peer_id: str):
        relays = list(self._relays.get(peer_id, []))
        random.shuffle(relays)
        errors = []
        for relay_id, relay_addr in relays:
            relay = PeerID.from_base58(relay_id)
            try:
                await self._connect(relay, [relay_addr])
                _, remote_reader, remote_writer = await asyncio.wait_for(
                    self.p2p.call_binary_stream_handler(relay, RELAY_PROTOCOL), self.connect_timeout_s
                )
                try:
                    await ask_relay(remote_reader, remote_writer, peer_id, self.connect_timeout_s)
                except RelayRefused:
                    remote_writer.close()
                    raise
                return remote_reader, remote_writer
            except Exception as exc:  # noqa: BLE001 - try the next relay
                errors.append(f"{relay_id[-8:]}: {exc or type(exc).__name__}")
        raise ConnectionError(f"no relay reached {peer_id[-8:]} ({'; '.join(errors) or 'its record names no relay'})")

    async def _on_local_relayed(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            remote_reader, remote_writer = await self._open_relayed(peer_id)
        except ConnectionError as exc:
            log.info("%s", exc)
            writer.close()
            return
        self.streams_out += 1
        await splice(
            reader,
            writer,
            remote_reader,
            remote_writer,
            lambda n: self.traffic.add("relayed", "out", n),
            lambda n: self.traffic.add("relayed", "in", n),
        )

    async def dial_out(self, peers: dict[str, list[str]], timeout_s: float = 5.0) -> int:
        """Open libp2p connections from us to directly reachable peers (peer id -> their libp2p
        addresses) we are not connected to. Behind NAT this is what lets those peers reach us
        without the relay: libp2p runs their streams to us over the connection we opened."""
        connected = {p.peer_id.to_base58() for p in await self.p2p.list_peers()}
        opened = 0
        for peer_id, addrs in peers.items():
            if peer_id in connected or not addrs:
                continue
            try:
                await asyncio.wait_for(
                    self.p2p._client.connect(PeerID.from_base58(peer_id), [DaemonMaddr(a) for a in addrs]), timeout_s
                )
                opened += 1
            except Exception as exc:  # noqa: BLE001 - retried on the next heartbeat
                log.debug("could not dial out to %s: %s", peer_id[-8:], exc)
        return opened

    async def connection_path(self, peer_id: str) -> str | None:
        """How our daemon is connected to `peer_id` right now (relayed / holepunched), or None."""
        try:
            peers = await self.p2p.list_peers()
        except Exception:  # noqa: BLE001
            return None
        for info in peers:
            if info.peer_id.to_base58() == peer_id and info.addrs:
                return "holepunched" if any(path_of(a) == "holepunched" for a in info.addrs) else "relayed"
        return None

    async def close(self) -> None:
        for server, _ in self._endpoints.values():
            server.close()
        self._endpoints.clear()
        try:
            await self.p2p.remove_binary_stream_handler(PROTOCOL)
            if self._tls_target is not None:
                await self.p2p.remove_binary_stream_handler(RELAYED_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - the daemon may already be gone
            log.debug("bridge handlers not removed: %r", exc)
        finally:  # also when a shutdown's deadline cancels us: a soak found a clean exit's folder left
            self._dir.cleanup()
