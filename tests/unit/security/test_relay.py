"""The relay splice's request format and the parsing of relays from a record's circuit addresses."""

import asyncio

import pytest

from noloco_node.transport.identity import NodeIdentity
from noloco_node.transport.relay import RelayRefused, encode_request, parse_request, read_line, relays_of


def _read_line(data: bytes) -> bytes:
    async def read() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_line(reader, 1.0)

    return asyncio.run(read())


def test_request_round_trip():
    peer = NodeIdentity.generate().peer_id
    assert parse_request(_read_line(encode_request(peer))) == peer


@pytest.mark.parametrize("line", [b"GET / HTTP/1.1", b"NLR1 not-a-peer-id", b"NLR1 ", b"NLR1 \xff\xfe"])
def test_malformed_requests_are_refused(line):
    with pytest.raises(RelayRefused):
        parse_request(line)


def test_request_lines_are_bounded():
    with pytest.raises(RelayRefused, match="line of"):
        _read_line(b"NLR1 " + b"x" * 500 + b"\n")
    with pytest.raises(RelayRefused, match="no complete line"):
        _read_line(b"NLR1 abc")  # the stream ends before a newline


def test_relays_of_reads_circuit_addresses():
    relay, target = NodeIdentity.generate().peer_id, NodeIdentity.generate().peer_id
    addrs = [
        f"/ip4/198.18.0.1/tcp/31330/p2p/{relay}/p2p-circuit/p2p/{target}",
        "/ip4/198.18.0.5/tcp/4001",
        f"/ip4/198.18.0.1/tcp/31330/p2p/{relay}",
    ]
    assert relays_of(addrs) == [(relay, f"/ip4/198.18.0.1/tcp/31330/p2p/{relay}")]
    assert relays_of([]) == []


class _Info:
    def __init__(self, peer_id: str) -> None:
        from hivemind.p2p import PeerID

        self.peer_id = PeerID.from_base58(peer_id)


class _FakeP2P:
    """Stands in for hivemind.P2P: the relay's connected peers, and targets that echo."""

    def __init__(self, me: str, connected: list[str]) -> None:
        from hivemind.p2p import PeerID

        self.peer_id = PeerID.from_base58(me)
        self.connected = connected
        self.opened: list[str] = []

    async def list_peers(self):
        return [_Info(p) for p in self.connected]

    async def call_binary_stream_handler(self, peer, protocol):
        self.opened.append(peer.to_base58())
        return None, *(await _pipe_to(_echo))


async def _echo(reader, writer):
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


_TASKS: set = set()  # the event loop keeps only weak references to tasks


async def _pipe_to(handler):
    """A (reader, writer) whose other end is served by `handler`."""
    import socket

    ours, theirs = socket.socketpair()
    their_reader, their_writer = await asyncio.open_connection(sock=theirs)
    task = asyncio.ensure_future(handler(their_reader, their_writer))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)
    return await asyncio.open_connection(sock=ours)


def test_relay_splices_and_bounds_circuits():
    from noloco_node.transport.relay import RelayService

    relay_id, caller, other, target, stranger = (NodeIdentity.generate().peer_id for _ in range(5))

    async def scenario():
        p2p = _FakeP2P(relay_id, connected=[caller, target])
        service = RelayService(p2p, max_per_source=2, max_circuits=8, connect_timeout_s=2.0)
        answers, open_streams = [], []

        async def dial(name: str, who: str):
            async def serve(reader, writer):
                await service._on_stream(_Info(who), reader, writer)

            reader, writer = await _pipe_to(serve)
            writer.write(encode_request(name))
            await writer.drain()
            answers.append(await read_line(reader, 2.0))
            open_streams.append((reader, writer))
            return reader, writer

        reader, writer = await dial(target, caller)
        writer.write(b"ping")
        await writer.drain()
        echoed = await asyncio.wait_for(reader.readexactly(4), 2.0)
        await dial(target, caller)
        await dial(target, caller)  # a third circuit from the same caller: over max_per_source
        await dial(stranger, other)  # not connected to the relay
        await dial(relay_id, other)  # the relay itself
        stats = service.stats()
        for _, w in open_streams:
            w.close()
        return echoed, answers, stats, p2p.opened

    echoed, answers, stats, opened = asyncio.run(scenario())
    assert echoed == b"ping"
    assert answers[:2] == [b"OK", b"OK"]
    assert answers[2].startswith(b"NO relay busy"), answers
    assert answers[3].startswith(b"NO") and b"not connected" in answers[3], answers
    assert answers[4].startswith(b"NO"), answers
    assert opened == [target, target]  # refused circuits never open a stream to anyone
    assert stats["circuits_total"] == 2 and stats["bytes_relayed"] >= 8
    assert stats["refused"] == {"busy": 1, "not_connected": 1, "malformed": 1}, stats


async def closed(reader: asyncio.StreamReader, within_s: float) -> bool:
    """The relay ended the stream (it aborts both legs: an end or a reset), within `within_s`."""
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except ConnectionResetError:
        return True


def test_circuits_that_carry_nothing_are_closed_and_free_their_places():
    """A hostile-peer audit's 8 throwaway identities held all 128 circuits for two minutes with
    streams that sent nothing after OK. Here: the unused one is closed after the connect timeout,
    the one that went quiet after the idle time, the one in use stays, and places come back."""
    from noloco_node.transport.relay import RelayService

    relay_id, caller, target = (NodeIdentity.generate().peer_id for _ in range(3))

    async def scenario():
        p2p = _FakeP2P(relay_id, connected=[caller, target])
        service = RelayService(p2p, max_per_source=3, max_circuits=8, connect_timeout_s=0.3, idle_s=0.8)

        async def dial():
            async def serve(reader, writer):
                await service._on_stream(_Info(caller), reader, writer)

            reader, writer = await _pipe_to(serve)
            writer.write(encode_request(target))
            await writer.drain()
            assert await read_line(reader, 2.0) == b"OK"
            return reader, writer

        unused, quiet, busy = await dial(), await dial(), await dial()
        for reader, writer in (quiet, busy):  # their TLS hellos; then quiet sends nothing more
            writer.write(b"hello")
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(5), 2.0) == b"hello"
        pings = 0

        async def keep_busy():  # a byte each way every 0.2 s, well within the idle time
            nonlocal pings
            while True:
                busy[1].write(b"p")
                await busy[1].drain()
                await asyncio.wait_for(busy[0].readexactly(1), 2.0)
                pings += 1
                await asyncio.sleep(0.2)

        pinging = asyncio.ensure_future(keep_busy())
        start = asyncio.get_running_loop().time()
        assert await closed(unused[0], 3.0)  # nothing sent after OK
        unused_s = asyncio.get_running_loop().time() - start
        quiet_closed = await closed(quiet[0], 3.0)  # quiet since its hello
        await asyncio.sleep(0.5)
        assert not pinging.done(), pinging.exception()
        pinging.cancel()
        assert pings >= 5
        busy[1].write(b"q")
        await busy[1].drain()
        still = await asyncio.wait_for(busy[0].readexactly(1), 2.0)
        stats = service.stats()
        busy[1].close()
        return unused_s, quiet_closed, still, stats

    unused_s, quiet_closed, still, stats = asyncio.run(scenario())
    assert unused_s < 2.0 and quiet_closed and still == b"q"
    assert stats["refused"].get("idle") == 2 and stats["circuits_open"] == 1, stats


def test_a_half_sent_request_line_takes_a_place_until_the_read_timeout():
    """A hostile-peer audit held streams with request lines lacking their newline: they were
    counted only once the line was whole, so they stood outside both caps for the read timeout."""
    from noloco_node.transport.relay import RelayService

    relay_id, caller, target = (NodeIdentity.generate().peer_id for _ in range(3))

    async def scenario():
        p2p = _FakeP2P(relay_id, connected=[caller, target])
        service = RelayService(p2p, max_per_source=2, max_circuits=8, connect_timeout_s=0.5)

        async def open_stream():
            async def serve(reader, writer):
                await service._on_stream(_Info(caller), reader, writer)

            return await _pipe_to(serve)

        half = [await open_stream() for _ in range(2)]
        for _, writer in half:
            writer.write(b"NLR1 " + target.encode()[:10])  # no newline
            await writer.drain()
        await asyncio.sleep(0.05)
        held = dict(service.active)
        reader, writer = await open_stream()  # a third stream from the same caller
        writer.write(encode_request(target))
        await writer.drain()
        third = await read_line(reader, 2.0)
        answers_to_half = [await read_line(r, 2.0) for r, _ in half]  # after the read timeout
        await asyncio.sleep(0.05)
        reader, writer = await open_stream()  # places free again
        writer.write(encode_request(target))
        await writer.drain()
        after = await read_line(reader, 2.0)
        writer.close()
        return held, third, answers_to_half, after

    held, third, answers_to_half, after = asyncio.run(scenario())
    assert held == {caller: 2}
    assert third.startswith(b"NO relay busy"), third
    assert all(a.startswith(b"NO no complete line") for a in answers_to_half), answers_to_half
    assert after == b"OK"
