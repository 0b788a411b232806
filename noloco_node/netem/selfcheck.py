"""Measure a link profile through a real relay on loopback before a run: round-trip time of a
1-byte ping-pong (median of `pings`) and one-way throughput of a bulk upload (bytes over the time
from the first byte sent to the receiver's acknowledgement, minus one round trip)."""

from __future__ import annotations

import asyncio
import statistics
import time

from noloco_node.netem.relay import LinkProfile, Relay


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """1-byte pings are echoed; a b'B' + 8-byte length starts a bulk upload acknowledged at its end."""
    try:
        while head := await reader.read(1):
            if head == b"B":
                size = int.from_bytes(await reader.readexactly(8), "big")
                await reader.readexactly(size)
                writer.write(b"A")
            else:
                writer.write(head)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def measure_link(profile: LinkProfile, *, pings: int = 15, upload_bytes: int | None = None) -> dict:
    """{'rtt_ms', 'mbit', ...} measured through a relay with `profile` in front of an echo server."""
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    relay = Relay(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", profile)
    await relay.start()
    if upload_bytes is None:  # about one second of the link, within 1..16 MiB
        upload_bytes = int(min(16 << 20, max(1 << 20, profile.bytes_per_s))) if profile.mbit else 16 << 20
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.listen_port)
    try:
        rtts = []
        for _ in range(pings):
            start = time.perf_counter()
            writer.write(b"p")
            await writer.drain()
            await reader.readexactly(1)
            rtts.append(time.perf_counter() - start)
        rtt = statistics.median(rtts)
        payload = bytes(upload_bytes)
        start = time.perf_counter()
        writer.write(b"B" + upload_bytes.to_bytes(8, "big"))
        for i in range(0, upload_bytes, 1 << 16):
            writer.write(payload[i : i + (1 << 16)])
            await writer.drain()
        await reader.readexactly(1)
        elapsed = time.perf_counter() - start
    finally:
        writer.close()
        # Let the close travel through the relay so every handler ends on EOF, not cancellation.
        await asyncio.sleep(2 * profile.one_way_ms / 1e3 + 0.05)
        await relay.close()
        server.close()
        await server.wait_closed()
    transfer_s = max(1e-6, elapsed - rtt)
    return {
        "profile": profile.to_dict(),
        "rtt_ms": rtt * 1e3,
        "rtt_ms_expected": 2 * profile.one_way_ms,
        "mbit": upload_bytes * 8 / transfer_s / 1e6,
        "mbit_expected": profile.mbit or None,
        "upload_bytes": upload_bytes,
    }
