"""A delaying, rate-limiting TCP relay: every byte through it sees the profile's one-way latency
(plus jitter) and bandwidth, in each direction independently.

Per direction a reader stamps each piece with `link_free = max(now, link_free) + len / rate`
(serialization at the bottleneck) and `deliver = link_free + delay + jitter` (kept monotone, as
TCP delivers in order); a writer sleeps until `deliver`. The reader stops reading while more
than ~50 ms worth of bytes are queued: that is the bottleneck buffer, and TCP back-pressure
stays end to end. Run one relay per node's gRPC port; the node announces the relay's address.

    python -m noloco_node.netem.relay --one-way-ms 25 --mbit 50 --route 40001=127.0.0.1:40000 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
from dataclasses import asdict, dataclass
from noloco_node.runtime.files import atomic_write_text

log = logging.getLogger(__name__)
PIECE = 16 * 1024


@dataclass(frozen=True)
class LinkProfile:
    name: str = "lan"
    one_way_ms: float = 0.0
    jitter_ms: float = 0.0
    """Uniform in [-jitter, +jitter] per piece, never reordering bytes."""
    mbit: float = 0.0
    """Bandwidth of each direction in Mbit/s; 0 = unlimited."""

    def __post_init__(self) -> None:
        if self.one_way_ms < 0 or self.jitter_ms < 0 or self.mbit < 0:
            raise ValueError(f"profile {self.name!r}: latency, jitter and bandwidth must be >= 0")
        if self.jitter_ms > self.one_way_ms:
            raise ValueError(f"profile {self.name!r}: jitter_ms {self.jitter_ms} exceeds one_way_ms {self.one_way_ms}")

    @property
    def bytes_per_s(self) -> float:
        return self.mbit * 1e6 / 8

    def to_dict(self) -> dict:
        return asdict(self)


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, profile: LinkProfile, rng: random.Random
) -> None:
    loop = asyncio.get_running_loop()
    rate, delay, jitter = profile.bytes_per_s, profile.one_way_ms / 1e3, profile.jitter_ms / 1e3
    limit = max(4 * PIECE, rate * 0.05) if rate else 64 * PIECE
    queue: asyncio.Queue = asyncio.Queue()
    state = {"backlog": 0, "link_free": 0.0, "last": 0.0}
    room = asyncio.Event()
    room.set()

    async def read_side() -> None:
        try:
            while True:
                await room.wait()
                data = await reader.read(PIECE)
                if not data:
                    break
                now = loop.time()
                state["link_free"] = max(now, state["link_free"]) + (len(data) / rate if rate else 0.0)
                deliver = state["link_free"] + delay + (rng.uniform(-jitter, jitter) if jitter else 0.0)
                state["last"] = deliver = max(deliver, state["last"])
                state["backlog"] += len(data)
                if state["backlog"] > limit:
                    room.clear()
                queue.put_nowait((deliver, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)

    async def write_side() -> None:
        try:
            while (item := await queue.get()) is not None:
                deliver, data = item
                wait = deliver - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                state["backlog"] -= len(data)
                if state["backlog"] <= limit:
                    room.set()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass

    await asyncio.gather(read_side(), write_side())


class Relay:
    """Listens on `listen_host:listen_port` and relays each connection to `upstream` (host:port)."""

    def __init__(
        self,
        upstream: str,
        profile: LinkProfile,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int = 0,
    ) -> None:
        self.upstream_host, _, port = upstream.rpartition(":")
        self.upstream_port = int(port)
        self.profile, self.listen_host, self.listen_port = profile, listen_host, listen_port
        self.rng = random.Random(seed)
        self.server: asyncio.base_events.Server | None = None
        self.connections = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, self.listen_host, self.listen_port)
        self.listen_port = self.server.sockets[0].getsockname()[1]
        return self.listen_port

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.upstream_host, self.upstream_port), timeout=10
            )
        except (OSError, asyncio.TimeoutError):
            client_writer.close()
            return
        try:
            await asyncio.gather(
                _pump(client_reader, up_writer, self.profile, self.rng),
                _pump(up_reader, client_writer, self.profile, self.rng),
            )
        except asyncio.CancelledError:
            pass  # the relay is shutting down
        finally:
            for w in (up_writer, client_writer):
                w.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def serve(routes: dict[int, str], profile: LinkProfile, ready_file: str | None) -> None:
    """A relay per route (listen port -> upstream) in this process, until SIGTERM/SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    relays = [Relay(upstream, profile, listen_port=port, seed=port) for port, upstream in routes.items()]
    bound = {str(await r.start()): f"{r.upstream_host}:{r.upstream_port}" for r in relays}
    if ready_file:
        atomic_write_text(ready_file, json.dumps({"profile": profile.to_dict(), "routes": bound}))
    await stop.wait()
    for relay in relays:
        await relay.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="custom")
    p.add_argument("--one-way-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--mbit", type=float, default=0.0, help="bandwidth per direction, 0 = unlimited")
    p.add_argument("--route", action="append", default=[], metavar="LISTEN_PORT=HOST:PORT")
    p.add_argument("--ready-file")
    args = p.parse_args(argv)
    routes = {}
    for route in args.route:
        port, _, upstream = route.partition("=")
        routes[int(port)] = upstream
    profile = LinkProfile(args.name, args.one_way_ms, args.jitter_ms, args.mbit)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(routes, profile, args.ready_file))


if __name__ == "__main__":
    main()
