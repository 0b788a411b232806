"""gRPC over libp2p: the same services, the same HTTP/2 bytes, carried on a libp2p stream.

A node that cannot be dialled directly is reached through its libp2p daemon (hivemind's p2pd):
hole-punched where libp2p manages it, through a circuit relay otherwise. The bridge keeps gRPC as
the one definition of the protocol by moving bytes, not messages:

    caller's gRPC channel -> unix socket (private dir) -> [bridge] -> libp2p stream "/noloco/grpc/1"
      -> callee's p2pd -> [bridge] -> TCP 127.0.0.1:<plaintext bridge port> -> callee's gRPC server

libp2p encrypts the link (TLS 1.3 or Noise) and its handshake proves the remote peer id. The callee
records which libp2p peer each of its loopback connections carries, so the admission interceptor
can require the call's signed identity to be that same peer (rpc/admission.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections import Counter
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

log = logging.getLogger(__name__)

PROTOCOL = "/noloco/grpc/1"
_PIECE = 256 << 10


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


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count) -> None:
    try:
        while True:
            data = await reader.read(_PIECE)
            if not data:
                break
            writer.write(data)
            count(len(data))
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError, OSError):
        pass


async def _splice(a_reader, a_writer, b_reader, b_writer, count_ab, count_ba) -> None:
    """Copy both ways; when either side ends, close both. HTTP/2 never half-closes its socket, so
    an end is always the link going away (a relay resetting its circuit, say): passing it on as a
    clean half-close would let gRPC read a cut stream as one the sender ended early, and strike it."""
    pumps = [asyncio.ensure_future(_pump(a_reader, b_writer, count_ab)),
             asyncio.ensure_future(_pump(b_reader, a_writer, count_ba))]
    try:
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in pumps:
            task.cancel()
        for w in (a_writer, b_writer):
            try:
                transport = w.transport
                transport.abort() if hasattr(transport, "abort") else w.close()
            except (OSError, RuntimeError, AttributeError):
                pass


class Libp2pBridge:
    def __init__(self, p2p: P2P, *, traffic: PathTraffic | None = None, connect_timeout_s: float = 10.0) -> None:
        self.p2p = p2p
        self.traffic = traffic or PathTraffic()
        self.connect_timeout_s = connect_timeout_s
        self._origins: dict[int, tuple[str, str]] = {}  # local port of a loopback connection -> (peer id, path)
        self._grpc_port: int | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="noloco-bridge-")
        os.chmod(self._dir.name, 0o700)  # only this user's processes may speak as us through it
        self._endpoints: dict[str, tuple[asyncio.AbstractServer, str]] = {}
        self._addrs: dict[str, list[str]] = {}
        self.streams_in = 0
        self.streams_out = 0

    # ---- serving: libp2p streams in, to our gRPC server ---------------------------------
    async def serve(self, grpc_port: int) -> None:
        """Accept libp2p streams for our gRPC server listening (plaintext) on 127.0.0.1:grpc_port."""
        self._grpc_port = grpc_port
        await self.p2p.add_binary_stream_handler(PROTOCOL, self._on_stream)

    def origin(self, grpc_peer: str) -> tuple[str, str] | None:
        """(libp2p peer id, path) of the loopback connection gRPC names `ipv4:127.0.0.1:PORT`."""
        host, _, port = grpc_peer.rpartition(":")
        if host not in ("ipv4:127.0.0.1", "ipv6:[::1]") or not port.isdigit():
            return None
        return self._origins.get(int(port))

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer_id, path = info.peer_id.to_base58(), path_of(info.addr)
        self.streams_in += 1
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", self._grpc_port), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError):
            writer.close()
            return
        local_port = up_writer.get_extra_info("sockname")[1]
        # Registered before a byte is forwarded, so gRPC cannot see the call before its origin.
        self._origins[local_port] = (peer_id, path)
        try:
            await _splice(reader, writer, up_reader, up_writer, lambda n: self.traffic.add(path, "in", n),
                          lambda n: self.traffic.add(path, "out", n))
        finally:
            # gRPC may still be finishing calls of this connection: forget its origin a little later.
            asyncio.get_running_loop().call_later(30.0, self._origins.pop, local_port, None)

    # ---- dialling: our gRPC channels out, over libp2p -----------------------------------
    async def endpoint(self, peer_id: str, addrs: list[str] | tuple[str, ...] = ()) -> str:
        """A gRPC target (unix socket) whose connections are carried to `peer_id` over libp2p."""
        if addrs:
            self._addrs[peer_id] = list(addrs)
        known = self._endpoints.get(peer_id)
        if known is not None:
            return known[1]
        sock = str(Path(self._dir.name) / f"{len(self._endpoints)}.sock")
        server = await asyncio.start_unix_server(lambda r, w: self._on_local(peer_id, r, w), path=sock)
        target = f"unix:{sock}"
        self._endpoints[peer_id] = (server, target)
        return target

    async def _open(self, peer_id: str):
        peer = PeerID.from_base58(peer_id)
        addrs = [DaemonMaddr(a) for a in self._addrs.get(peer_id, [])]
        if addrs:
            try:  # teach our daemon where the peer is (a circuit address through its relay, say)
                await asyncio.wait_for(self.p2p._client.connect(peer, addrs), self.connect_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the stream open below reports the real failure
                log.debug("connect to %s via %s failed: %s", peer_id[-8:], addrs, exc)
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
        await _splice(reader, writer, remote_reader, remote_writer, lambda n: self.traffic.add(path, "out", n),
                      lambda n: self.traffic.add(path, "in", n))

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
                await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer_id),
                                                                [DaemonMaddr(a) for a in addrs]), timeout_s)
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
        except Exception:  # noqa: BLE001 - the daemon may already be gone
            pass
        self._dir.cleanup()
