"""Copying bytes both ways between two stream pairs, as the bridge and the relay do."""

from __future__ import annotations

import asyncio

_PIECE = 256 << 10


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


async def splice(a_reader, a_writer, b_reader, b_writer, count_ab, count_ba) -> None:
    """Copy both ways; when either side ends, close both. HTTP/2 never half-closes its socket, so
    an end is always the link going away (a relay resetting its circuit, say): passing it on as a
    clean half-close would let gRPC read a cut stream as one the sender ended early, and strike it."""
    pumps = [
        asyncio.ensure_future(_pump(a_reader, b_writer, count_ab)),
        asyncio.ensure_future(_pump(b_reader, a_writer, count_ba)),
    ]
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
